"""`make compose-check`: compose.yaml on a real Docker engine, as a user brings it up, and what it promises checked.

One line per step with its time. In order: the engine (Debian's docker.io and docker-compose installed where
missing, dockerd started where not running), the base images (pulled, or made here where Docker Hub cannot be
reached: Debian bookworm with Python 3.11 by mmdebstrap, and Valkey from Debian on it), the image built, the run's
secrets made by `tinker-atropos secrets`, the stack brought up with compose.yaml and a Pendulum config through its
variables, then: every container healthy; `status` from inside the trainer lists every service; the run learns
within a budget; an env container's process and then the trainer's SIGKILLed (a crash: the restart policy brings
each back, the run goes on, policy version and env steps never go back); `--scale env=3`; no port published, each
container unprivileged on a read-only root without capabilities, and a client on the project network without the
secrets refused by Valkey and every gRPC port; `down -v` leaves nothing of the project.

It runs as its own Compose project (PROJECT), from a folder of its own (its ./secrets; ./configs is the repository's),
so a stack of the repository's own folder is never touched. It leaves the built image and the base images it made
(reused on the next run), and nothing else: no container, network, volume or file, not the image a rebuild
replaced; a dockerd it started is stopped, one that was running is left running.
Needs root (the engine). Usage: python deploy/compose_check.py [--learn-budget-s S]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("compose_probe.py")
PROJECT = "tinker-atropos-check"
NETWORK = f"{PROJECT}_default"
LABEL = f"com.docker.compose.project={PROJECT}"
CONFIG = "pendulum.yaml"  # learns in minutes
ENV_INSTANCES = 4
ENV_CONTAINERS = 2  # 8 instances, as configs/pendulum.yaml asks of `up`
SCALED_ENV_CONTAINERS = 3
TARGET_RETURN = -400.0  # Pendulum-v1's mean return over the latest 10 episodes
# Counted from `up`. On the 2-core development machine shared with other work (load average 4 to 10) the run
# reached the target 84-127 s after `up` in eight runs: the budget is 3.3 times the slowest.
LEARN_BUDGET_S = 420.0
HEALTHY_TIMEOUT_S = 240.0
RECOVERY_TIMEOUT_S = 180.0
SERVICE_USER = "10001:10001"  # the Dockerfile's USER
VALKEY_USER = "999:999"  # compose.yaml's redis service
# Made here where Docker Hub cannot be reached (kept and reused by the next run).
LOCAL_PYTHON_IMAGE = "tinker-atropos-base/python:3.11-bookworm"
LOCAL_VALKEY_IMAGE = "tinker-atropos-base/valkey:bookworm-backports"
DEBIAN = "http://deb.debian.org/debian"
DEBIAN_SOURCES = [
    f"deb {DEBIAN} bookworm main",
    f"deb {DEBIAN} bookworm-updates main",
    f"deb {DEBIAN}-security bookworm-security main",
]
BASE_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"
# /usr merged as bookworm has it, without the usrmerge package, which would bring perl (47 MB) into the image.
MERGED_USR_HOOK = "/usr/share/mmdebstrap/hooks/merged-usr"
# What python:3.11-slim leaves out too: the base image's size is then close to it.
DPKG_EXCLUDES = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
]


class CheckFailed(Exception):
    pass


def log(message: str) -> None:
    print(message, flush=True)


class Steps:
    """Prints each step as one line: time since the start, the step's own time, its name and what it found."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[list[str]]:
        began = time.monotonic()
        detail: list[str] = []
        try:
            yield detail
        except CheckFailed as error:
            self._line(began, "FAIL", name, str(error))
            raise
        self._line(began, "ok", name, "; ".join(detail))

    def _line(self, began: float, verdict: str, name: str, detail: str) -> None:
        now = time.monotonic()
        log(f"{now - self.started:7.1f} s {now - began:6.1f} s  {verdict:4}  {name}: {detail}")


def run(
    argv: list[str], *, check: bool = True, timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise CheckFailed(
            f"`{' '.join(argv)}` exited {result.returncode}: {(result.stderr or result.stdout)[-2000:]}"
        )
    return result


def apt_install(*packages: str) -> None:
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=environment)
    run(["apt-get", "install", "-y", "-qq", *packages], env=environment, timeout=1200)


# --- the engine ---------------------------------------------------------------------------------------------


class Engine:
    """The docker client and Compose command to use, and the dockerd this check started (None: it was running)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.daemon: subprocess.Popen | None = None
        self.docker = ""
        self.compose: list[str] = []

    def ensure(self, detail: list[str]) -> None:
        if shutil.which("dockerd") is None or not (
            shutil.which("docker-compose") or self._has_compose_plugin(shutil.which("docker"))
        ):
            apt_install("docker.io", "docker-compose")
            detail.append("installed docker.io and docker-compose")
        self.docker = self._builder_client()
        if run([self.docker, "info"], check=False, timeout=30).returncode != 0:
            self._start_daemon()
            detail.append("dockerd started by this check")
        else:
            detail.append("dockerd was running")
        self.compose = (
            [self.docker, "compose"] if self._has_compose_plugin(self.docker) else ["docker-compose"]
        )
        server = run([self.docker, "version", "-f", "{{.Server.Version}}"]).stdout.strip()
        compose = run([*self.compose, "version", "--short"]).stdout.strip()
        detail.append(f"Docker Engine {server}, Compose {compose}, client {self.docker}")

    @staticmethod
    def _has_compose_plugin(docker: str | None) -> bool:
        return bool(docker) and run([docker, "compose", "version"], check=False).returncode == 0

    @staticmethod
    def _builder_client() -> str:
        """A client that builds with BuildKit (the Dockerfile's mounts and secrets need it): one with the buildx
        plugin, or one older than 23, which has BuildKit built in (Debian 12's /usr/bin/docker)."""
        candidates = [shutil.which("docker"), "/usr/bin/docker"]
        for client in dict.fromkeys(c for c in candidates if c and Path(c).exists()):
            if run([client, "buildx", "version"], check=False).returncode == 0:
                return client
            version = run([client, "version", "-f", "{{.Client.Version}}"], check=False).stdout
            if version and int(version.split(".")[0]) < 23:
                return client
        raise CheckFailed(
            "no docker client that builds with BuildKit: install the buildx plugin (docker-buildx)"
        )

    def _start_daemon(self) -> None:
        with (self.work / "dockerd.log").open("w") as output:
            self.daemon = subprocess.Popen(
                ["dockerd"],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while run([self.docker, "info"], check=False, timeout=30).returncode != 0:
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"dockerd did not start: {(self.work / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def stop_daemon(self) -> None:
        """Stops the dockerd this check started (its containerd with it)."""
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(timeout=60)

    def docker_json(self, *argv: str) -> Any:
        return json.loads(run([self.docker, *argv]).stdout)

    def has_image(self, reference: str) -> bool:
        return run([self.docker, "image", "inspect", reference], check=False).returncode == 0

    def image_size_mb(self, reference: str) -> float:
        return int(run([self.docker, "image", "inspect", "-f", "{{.Size}}", reference]).stdout) / 1e6


# --- images ---------------------------------------------------------------------------------------------------


def dockerfile_default(name: str) -> str:
    [default] = re.findall(rf"^ARG {name}=(\S*)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    return default


def compose_default(variable: str) -> str:
    [default] = re.findall(rf"\$\{{{variable}:-([^}}]+)\}}", (ROOT / "compose.yaml").read_text())
    return default


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def torch_pin() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [d.split("==")[1] for d in dependencies if d.startswith("torch==")]
    return pin


def pip_config() -> dict[str, str]:
    """pip's settings on this machine (`pip config list`: the find-links folder, the CA bundle)."""
    listed = run([sys.executable, "-m", "pip", "config", "list"], check=False).stdout
    settings = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".")[-1]] = value.strip().strip("'\"")
    return settings


def base_image(engine: Engine, public: str, local: str, make: Callable[[], None], detail: list[str]) -> str:
    """``public`` where it is here or can be pulled, else ``local``, made by ``make`` unless an earlier run made it."""
    if (
        engine.has_image(public)
        or run([engine.docker, "pull", public], check=False, timeout=300).returncode == 0
    ):
        detail.append(f"{public}")
        return public
    if engine.has_image(local):
        detail.append(f"{public} cannot be pulled: {local} (made by an earlier run)")
    else:
        began = time.monotonic()
        make()
        detail.append(f"{public} cannot be pulled: made {local} in {time.monotonic() - began:.0f} s")
    return local


def make_python_base(engine: Engine, work: Path) -> None:
    """Debian bookworm with its security updates, Python 3.11, its venv module and the CA bundle: what the
    Dockerfile asks of PYTHON_IMAGE."""
    if shutil.which("mmdebstrap") is None:
        apt_install("mmdebstrap")
    tarball = work / "python-base.tar"
    run(
        ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "--aptopt=APT::Install-Recommends false",
         f"--hook-dir={MERGED_USR_HOOK}",
         *(f"--dpkgopt={option}" for option in DPKG_EXCLUDES), "bookworm", str(tarball), *DEBIAN_SOURCES],
        timeout=1800,
    )  # fmt: skip
    run([engine.docker, "import", "-c", 'CMD ["python3"]', str(tarball), LOCAL_PYTHON_IMAGE], timeout=600)
    tarball.unlink()


def make_valkey(engine: Engine, base: str) -> None:
    dockerfile = (ROOT / "deploy" / "valkey.Dockerfile").read_text()
    run(
        [engine.docker, "build", "--build-arg", f"BASE={base}", "-t", LOCAL_VALKEY_IMAGE, "-"],
        input=dockerfile,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
        timeout=1200,
    )


@contextlib.contextmanager
def wheelhouse(detail: list[str]) -> Iterator[list[str]]:
    """The build arguments for torch: this machine's CPU wheel of the pinned version (pip's find-links) linked into
    deploy/wheelhouse for the build, with no index; the Dockerfile's default (the CPU index) where there is none."""
    settings = pip_config()
    wheels = [
        wheel
        for folder in settings.get("find-links", "").split()
        for wheel in Path(folder.removeprefix("file://")).glob(f"torch-{torch_pin()}+cpu-cp311-*.whl")
    ]
    arguments = ["--secret", f"id=pip-ca,src={settings['cert']}"] if settings.get("cert") else []
    if not wheels:
        detail.append("torch from the CPU index")
        yield arguments
        return
    linked = ROOT / "deploy" / "wheelhouse" / wheels[0].name
    made = not linked.exists()
    if made:
        try:
            os.link(wheels[0], linked)
        except OSError:  # another file system
            shutil.copyfile(wheels[0], linked)
    detail.append(f"torch from {wheels[0]}")
    try:
        yield [*arguments, "--build-arg", "TORCH_INDEX="]
    finally:
        if made:
            linked.unlink()


def build_image(
    engine: Engine, image: str, build_args: list[str], options: list[str], work: Path, detail: list[str]
) -> None:
    """`docker build` of the repository as ``image``. The image the tag named before, which the build leaves
    untagged when anything changed, is removed (where no container or other tag holds it): one image stays."""
    before = run([engine.docker, "image", "inspect", "-f", "{{.Id}}", image], check=False).stdout.strip()
    build_log = work / "build.log"
    began = time.monotonic()
    with build_log.open("w") as output:
        built = subprocess.run(
            [engine.docker, "build", "--progress=plain", *(f"--build-arg={a}" for a in build_args), *options,
             "-t", image, str(ROOT)],
            stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "DOCKER_BUILDKIT": "1"}, timeout=3600,
        )  # fmt: skip
    if built.returncode != 0:
        raise CheckFailed(f"docker build failed:\n{build_log.read_text()[-4000:]}")
    took, cached = time.monotonic() - began, build_log.read_text().count(" CACHED")
    after = run([engine.docker, "image", "inspect", "-f", "{{.Id}}", image]).stdout.strip()
    if before and before != after:
        run([engine.docker, "image", "rm", before], check=False)
    detail.insert(
        0, f"{image} built in {took:.0f} s ({cached} steps cached), {engine.image_size_mb(image):.0f} MB"
    )


# --- the stack --------------------------------------------------------------------------------------------------


class Stack:
    """The Compose project of this check."""

    def __init__(self, engine: Engine, folder: Path, valkey_image: str, image: str) -> None:
        self.engine, self.folder, self.image = engine, folder, image
        self.environment = {
            **os.environ,
            "TA_COMPOSE_CONFIG": CONFIG,
            "TA_COMPOSE_ENV_INSTANCES": str(ENV_INSTANCES),
            "VALKEY_IMAGE": valkey_image,
        }
        self.run_name = yaml.safe_load((ROOT / "configs" / CONFIG).read_text())["run"]["name"]

    def compose(self, *argv: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        command = [*self.engine.compose, "-p", PROJECT, "-f", str(ROOT / "compose.yaml"),
                   "--project-directory", str(self.folder), *argv]  # fmt: skip
        return run(command, check=check, timeout=timeout, env=self.environment)

    def containers(self) -> list[dict[str, Any]]:
        """`docker inspect` of every container of the project, running or not."""
        ids = run([self.engine.docker, "ps", "-aq", "--filter", f"label={LABEL}"]).stdout.split()
        return self.engine.docker_json("inspect", *ids) if ids else []

    def service_containers(self, service: str) -> list[dict[str, Any]]:
        return [
            c for c in self.containers() if c["Config"]["Labels"].get("com.docker.compose.service") == service
        ]

    def leftovers(self) -> list[str]:
        docker = self.engine.docker
        found = []
        for kind, listing in (
            ("container", [docker, "ps", "-aq", "--filter", f"label={LABEL}"]),
            ("network", [docker, "network", "ls", "-q", "--filter", f"label={LABEL}"]),
            ("volume", [docker, "volume", "ls", "-q", "--filter", f"label={LABEL}"]),
        ):
            found += [f"{kind} {name}" for name in run(listing).stdout.split()]
        return found

    def down(self) -> None:
        run([self.engine.docker, "rm", "-f", f"{PROJECT}-watch"], check=False)
        self.compose("down", "-v", "--remove-orphans", "--timeout", "60", check=False, timeout=300)


def wait_until(
    condition: Callable[[], Any], timeout_s: float, what: Callable[[], str], every_s: float = 1.0
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise CheckFailed(f"not within {timeout_s:.0f} s: {what()}")
        time.sleep(every_s)


def health_of(container: dict[str, Any]) -> str:
    state = container["State"]
    return state.get("Health", {}).get("Status", state["Status"])


class Watch:
    """A container on the project network that reads the registry and the counters every second (compose_probe
    watch), and every line it printed."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lines: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        docker = stack.engine.docker
        run(
            [docker, "run", "-d", "--name", f"{PROJECT}-watch", "--network", NETWORK,
             *probe_options(stack, with_secrets=True), stack.image, "/probe.py", "watch", stack.run_name],
        )  # fmt: skip
        self.logs = subprocess.Popen(
            [docker, "logs", "-f", f"{PROJECT}-watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.logs.stdout is not None
        for text in self.logs.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                line = json.loads(text)
                if "error" not in line:
                    with self.lock:
                        self.lines.append(line)

    def latest(self) -> dict[str, Any]:
        with self.lock:
            return self.lines[-1] if self.lines else {"policy_version": 0, "env_steps": 0, "services": []}

    def after(self, t: float) -> list[dict[str, Any]]:
        with self.lock:
            return [line for line in self.lines if line["t"] > t]

    def never_went_back(self) -> str | None:
        """What went back, if anything: the policy version or the env steps between two readings."""
        with self.lock:
            lines = list(self.lines)
        for previous, line in itertools.pairwise(lines):
            for counter in ("policy_version", "env_steps"):
                if line[counter] < previous[counter]:
                    return f"{counter} went back from {previous[counter]} to {line[counter]}"
        return None

    def close(self) -> None:
        self.logs.terminate()
        self.logs.wait()


def probe_options(stack: Stack, with_secrets: bool) -> list[str]:
    """`docker run` options of a probe container: the image's Python running compose_probe.py, hardened like the
    services; with the run's Redis password and TLS files, or (an intruder) with the CA and certificate only."""
    secrets = stack.folder / "secrets"
    options = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
               "-v", f"{PROBE}:/probe.py:ro", "--entrypoint", "python",
               "-e", "TA_TLS_CA=/run/secrets/ca.crt", "-e", "TA_TLS_CERT=/run/secrets/tls.crt",
               "-e", "TA_TLS_KEY=/run/secrets/tls.key", "-e", "TA_TLS_SERVER_NAME=tinker-atropos"]  # fmt: skip
    files = ["ca.crt", "tls.crt", "tls.key"]
    if with_secrets:
        options += [
            "-e",
            "TA_REDIS_URL=redis://redis:6379/0",
            "-e",
            "TA_REDIS_PASSWORD_FILE=/run/secrets/redis-password",
        ]
        files.append("redis-password")
    for file in files:
        options += ["-v", f"{secrets / file}:/run/secrets/{file}:ro"]
    return options


def services_of(line: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [s for s in line["services"] if s["kind"] == kind]


def record_of(line: dict[str, Any], container: dict[str, Any]) -> dict[str, Any] | None:
    """The registry record of a container: the one whose address is the container's hostname."""
    hostname = container["Config"]["Hostname"]
    return next((s for s in line["services"] if s["address"].split(":")[0] == hostname), None)


def process_status(container: dict[str, Any]) -> dict[str, str]:
    """The kernel's view of the container's main process (/proc/PID/status)."""
    text = Path(f"/proc/{container['State']['Pid']}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


# --- the steps ----------------------------------------------------------------------------------------------------


def crash(stack: Stack, watch: Watch, service: str, detail: list[str]) -> None:
    """SIGKILL the main process of one container of ``service`` from the host, as the OOM killer does (`docker
    kill` would be an operator's stop, after which Docker's restart policy does not restart the container), then
    wait for the restart policy to bring it back and for the run to go on past where it was."""
    [container, *_] = sorted(stack.service_containers(service), key=lambda c: c["Name"])
    before = record_of(watch.latest(), container)
    if before is None:
        raise CheckFailed(f"{container['Name']} is not in the registry")
    version, steps = watch.latest()["policy_version"], watch.latest()["env_steps"]
    killed_at = time.time()
    os.kill(container["State"]["Pid"], signal.SIGKILL)

    def inspect() -> dict[str, Any]:
        [now] = stack.engine.docker_json("inspect", container["Id"])
        return now

    def restarted() -> dict[str, Any] | None:
        now = inspect()
        return now if now["RestartCount"] > container["RestartCount"] and now["State"]["Running"] else None

    now = wait_until(restarted, RECOVERY_TIMEOUT_S, lambda: f"{container['Name']} not restarted")
    restarted_s = time.time() - killed_at

    def going_on() -> bool:
        line = watch.latest()
        record = record_of(line, now)
        return (
            record is not None
            and record["incarnation"] != before["incarnation"]
            and line["policy_version"] > version
            and line["env_steps"] > steps
            and (service != "env" or (record["steps"] or 0) > 0)
        )

    wait_until(going_on, RECOVERY_TIMEOUT_S, lambda: f"the run did not go on: {watch.latest()}")
    going_on_s, line = time.time() - killed_at, watch.latest()
    wait_until(
        lambda: health_of(inspect()) == "healthy",
        RECOVERY_TIMEOUT_S,
        lambda: f"{container['Name']} unhealthy",
    )
    problem = watch.never_went_back()
    if problem:
        raise CheckFailed(problem)
    detail.append(
        f"{container['Name'].lstrip('/')} SIGKILLed: restarted by the policy after {restarted_s:.0f} s "
        f"(RestartCount {now['RestartCount']}); the run went on after {going_on_s:.0f} s (a new incarnation "
        f"registered{', stepped' if service == 'env' else ''}; policy version {version} -> {line['policy_version']}, "
        f"env steps {steps} -> {line['env_steps']}, neither ever went back); healthy after "
        f"{time.time() - killed_at:.0f} s"
    )


def conclude(problems: list[str], detail: list[str], summary: str) -> None:
    """The step fails with every problem found, or says what it checked."""
    if problems:
        raise CheckFailed("; ".join(problems))
    detail.append(summary)


def check_hardening(stack: Stack, detail: list[str]) -> None:
    problems = []
    containers = [c for c in stack.containers() if c["State"]["Running"]]
    for container in containers:
        name, host = container["Name"].lstrip("/"), container["HostConfig"]
        service = container["Config"]["Labels"]["com.docker.compose.service"]
        published = {
            port: bound for port, bound in (container["NetworkSettings"]["Ports"] or {}).items() if bound
        }
        if published or host.get("PortBindings"):
            problems.append(f"{name} publishes {published or host['PortBindings']}")
        user = VALKEY_USER if service == "redis" else SERVICE_USER
        if container["Config"]["User"] != user:
            problems.append(f"{name} runs as {container['Config']['User']!r}, not {user}")
        if not host["ReadonlyRootfs"]:
            problems.append(f"{name}: root filesystem writable")
        if host["CapDrop"] != ["ALL"] or host["CapAdd"] or host["Privileged"]:
            problems.append(f"{name}: CapDrop {host['CapDrop']}, CapAdd {host['CapAdd']}")
        if "no-new-privileges:true" not in (host["SecurityOpt"] or []):
            problems.append(f"{name}: no no-new-privileges")
        # What the kernel says of the running process.
        status = process_status(container)
        uids = set(status["Uid"].split())
        if uids != {user.split(":")[0]} or int(status["CapEff"], 16) or int(status["CapBnd"], 16):
            problems.append(
                f"{name}: Uid {status['Uid']}, CapEff {status['CapEff']}, CapBnd {status['CapBnd']}"
            )
        if status.get("NoNewPrivs") != "1":
            problems.append(f"{name}: NoNewPrivs {status.get('NoNewPrivs')}")
    conclude(
        problems,
        detail,
        f"{len(containers)} containers: no port published; users {SERVICE_USER} (ours) and {VALKEY_USER} (Valkey), "
        "read-only root, CapDrop ALL, no-new-privileges (docker inspect); the kernel agrees for each main process "
        "(Uid, CapEff 0, CapBnd 0, NoNewPrivs 1)",
    )


def check_intruder(stack: Stack, watch: Watch, detail: list[str]) -> None:
    addresses = sorted(s["address"] for s in watch.latest()["services"])
    result = run(
        [stack.engine.docker, "run", "--rm", "--network", NETWORK, *probe_options(stack, with_secrets=False),
         stack.image, "/probe.py", "intrude", *addresses],
        timeout=300,
    )  # fmt: skip
    answers = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    problems = []
    [valkey] = [a for a in answers if a["how"] == "redis without AUTH"]
    if "NOAUTH" not in valkey["answer"] and "Authentication" not in valkey["answer"]:
        problems.append(f"Valkey answered {valkey['answer']!r}")
    for answer in answers:
        if answer["how"] != "redis without AUTH" and answer["answer"] == "OK":
            problems.append(f"{answer['target']} answered {answer['how']}")
    for address in addresses:  # the transport let it through: the token check refused it
        tokenless = [
            a for a in answers if a["target"] == address and a["how"] == "mutual TLS without the token"
        ]
        if [a["answer"] for a in tokenless] != ["UNAUTHENTICATED"]:
            problems.append(f"{address} without the token: {tokenless}")
    conclude(
        problems,
        detail,
        f"Valkey: {valkey['answer'].split(':')[0]}; {len(addresses)} gRPC ports: plaintext and TLS without a client "
        "certificate refused, mutual TLS without the token UNAUTHENTICATED",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learn-budget-s", type=float, default=LEARN_BUDGET_S)
    arguments = parser.parse_args()
    if os.geteuid() != 0:
        log("make compose-check needs root: it installs and starts the Docker engine where it is missing")
        return 2
    steps = Steps()
    work = Path(tempfile.mkdtemp(prefix="ta-compose-check-"))
    engine = Engine(work)
    stack: Stack | None = None
    watch: Watch | None = None
    image = f"tinker-atropos:{package_version()}"
    try:
        with steps.step("engine") as detail:
            engine.ensure(detail)
        with steps.step("base images") as detail:
            python_image = base_image(
                engine,
                dockerfile_default("PYTHON_IMAGE"),
                LOCAL_PYTHON_IMAGE,
                lambda: make_python_base(engine, work),
                detail,
            )
            valkey_image = base_image(
                engine,
                compose_default("VALKEY_IMAGE"),
                LOCAL_VALKEY_IMAGE,
                lambda: make_valkey(engine, python_image),
                detail,
            )
        with steps.step("image") as detail, wheelhouse(detail) as torch_arguments:
            build_image(engine, image, [f"PYTHON_IMAGE={python_image}"], torch_arguments, work, detail)
        folder = work / "project"
        folder.mkdir()
        (folder / "configs").symlink_to(ROOT / "configs")
        stack = Stack(engine, folder, valkey_image, image)
        with steps.step("secrets") as detail:
            cli = Path(sys.executable).with_name("tinker-atropos")
            run([str(cli), "secrets", str(folder / "secrets"), "--world-readable"])
            detail.append(f"`tinker-atropos secrets secrets --world-readable` in {folder}")
        with steps.step("up") as detail:
            if stack.leftovers():
                stack.down()
                detail.append("an earlier run's leftovers removed")
            stack.compose("up", "-d", "--no-build", "--scale", f"env={ENV_CONTAINERS}", timeout=600)
            detail.append(
                f"{CONFIG}, {ENV_CONTAINERS} env containers x {ENV_INSTANCES} instances, Valkey {valkey_image}"
            )
        up_at = time.time()
        with steps.step("healthy") as detail:
            expected = 3 + ENV_CONTAINERS
            wait_until(
                lambda: (
                    len(cs := stack.containers()) == expected and all(health_of(c) == "healthy" for c in cs)
                ),
                HEALTHY_TIMEOUT_S,
                lambda: ", ".join(f"{c['Name'].lstrip('/')} {health_of(c)}" for c in stack.containers()),
            )
            detail.append(f"all {expected} containers healthy")
        watch = Watch(stack)
        with steps.step("status") as detail:

            def listed() -> str | None:
                shown = stack.compose("exec", "-T", "trainer", "tinker-atropos", "status", "--run", stack.run_name,
                                      check=False).stdout  # fmt: skip
                ours = [
                    c
                    for c in stack.containers()
                    if c["Config"]["Labels"]["com.docker.compose.service"] != "redis"
                ]
                return shown if all(c["Config"]["Hostname"] in shown for c in ours) else None

            shown = wait_until(listed, 60, lambda: "status does not list every container", every_s=3)
            kinds = {
                kind: len(re.findall(rf"^\W*{kind}\W", shown, re.MULTILINE))
                for kind in ("env", "rollout", "trainer")
            }
            detail.append(f"`status` in the trainer lists every container: {kinds}")
        with steps.step("learns") as detail:

            def learned() -> dict[str, Any] | None:
                line = watch.latest()
                return (
                    line
                    if line.get("mean_return") is not None and line["mean_return"] >= TARGET_RETURN
                    else None
                )

            line = wait_until(learned, arguments.learn_budget_s - (time.time() - up_at),
                              lambda: f"mean return {watch.latest().get('mean_return')} (target {TARGET_RETURN})")  # fmt: skip
            detail.append(
                f"mean return {line['mean_return']:.1f} >= {TARGET_RETURN:.0f} {line['t'] - up_at:.0f} s after `up` "
                f"(budget {arguments.learn_budget_s:.0f} s): {line['env_steps']} env steps, policy version "
                f"{line['policy_version']}"
            )
        with steps.step("crash an env container") as detail:
            crash(stack, watch, "env", detail)
        with steps.step("crash the trainer") as detail:
            crash(stack, watch, "trainer", detail)
        with steps.step(f"--scale env={SCALED_ENV_CONTAINERS}") as detail:
            stack.compose(
                "up", "-d", "--no-build", "--no-recreate", "--scale", f"env={SCALED_ENV_CONTAINERS}"
            )
            scaled_at = time.time()

            def all_stepped() -> list[dict[str, Any]] | None:
                envs = stack.service_containers("env")
                if len(envs) != SCALED_ENV_CONTAINERS or not all(health_of(c) == "healthy" for c in envs):
                    return None
                # from the first reading that has all of them in the registry to the latest
                lines = [line for line in watch.after(scaled_at) if all(record_of(line, c) for c in envs)]
                if not lines:
                    return None
                first, last = lines[0], lines[-1]
                records = [(record_of(first, c), record_of(last, c)) for c in envs]
                stepping = [b for a, b in records if (b["steps"] or 0) > (a["steps"] or 0)]  # type: ignore[index]
                return (
                    stepping
                    if len(stepping) == SCALED_ENV_CONTAINERS
                    and len(services_of(last, "env")) == SCALED_ENV_CONTAINERS
                    else None
                )

            stepping = wait_until(
                all_stepped, RECOVERY_TIMEOUT_S, lambda: f"env services: {services_of(watch.latest(), 'env')}"
            )
            detail.append(
                f"{SCALED_ENV_CONTAINERS} env services in the registry, each stepped since: "
                + ", ".join(f"{s['address']} {s['steps']} steps" for s in stepping)
            )
        with steps.step("hardening") as detail:
            check_hardening(stack, detail)
        with steps.step("unauthenticated client") as detail:
            check_intruder(stack, watch, detail)
        with steps.step("down -v") as detail:
            watch.close()
            watch = None
            stack.down()
            left = stack.leftovers()
            if left:
                raise CheckFailed(f"left behind: {', '.join(left)}")
            detail.append("no container, network or volume of the project left")
        log(f"compose-check passed in {time.monotonic() - steps.started:.0f} s")
        return 0
    except CheckFailed:
        if stack is not None:
            logs = stack.compose("logs", "--no-color", "--tail", "30", check=False).stdout
            log(f"--- the last lines of each service's log ---\n{logs}")
        return 1
    finally:
        if watch is not None:
            watch.close()
        if stack is not None:
            stack.down()
        engine.stop_daemon()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
