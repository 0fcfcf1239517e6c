"""The documentation's snippets run as written against an `up` run: the blocks marked ``<!-- snippet: NAME -->`` are
taken from README.md and the site's pages (docs/), and run in a folder laid out as the repository (``.venv``,
``examples``, ``configs``), where `up` makes ``runs/``. The line that starts `up` in the background runs first; the
rest, in one shell, once `up` is as far as the page says to wait for. A snippet shown in several places (the
README's quick start and its page) must be the same in each. The run's secrets stay its own: a process without
them is refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml

from tests.support.docs import DOCUMENTS, marked_snippets
from tests.support.processes import wait_for
from tests.support.running import REPO
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.processes import free_port
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration


def snippets(name: str) -> list[tuple[str, str]]:
    """(language, code) of each block of snippet NAME, in order: the same in every file that shows it."""
    shown = {}
    for document in DOCUMENTS:
        found = [
            (language, code)
            for snippet, language, code in marked_snippets(document.read_text())
            if snippet == name
        ]
        if found:
            shown[document.relative_to(REPO).as_posix()] = found
    assert shown, f"no snippet {name!r} in README.md or docs/"
    first = next(iter(shown.values()))
    differ = [where for where, blocks in shown.items() if blocks != first]
    assert not differ, f"snippet {name!r} differs between {list(shown)[0]} and {differ}"
    return first


def workspace(directory: Path, **examples: str) -> Path:
    """A folder laid out as the repository, ``examples`` replaced by the given texts (a free port for a test)."""
    (directory / ".venv").symlink_to(REPO / ".venv")
    (directory / "configs").symlink_to(REPO / "configs")
    (directory / "examples").mkdir()
    for example in (REPO / "examples").iterdir():
        target = directory / "examples" / example.name
        if example.name in examples:
            target.write_text(examples[example.name])
        else:
            target.symlink_to(example)
    return directory


class Snippet:
    """A bash block (and the Python block after it): its ``... &`` line, then the rest in one shell."""

    def __init__(self, name: str, folder: Path) -> None:
        blocks, self.folder = snippets(name), folder
        shell = [line for line in blocks[0][1].splitlines() if line.strip()]
        background = [line for line in shell if line.split("#")[0].strip().endswith("&")]
        assert len(background) == 1, shell
        self.start_line = background[0].split("#")[0].strip().removesuffix("&").strip()
        self.rest = [line for line in shell if line is not background[0]]
        if len(blocks) > 1:  # the Python block, as a script the shell runs
            (folder / "snippet.py").write_text(blocks[1][1])
            self.rest.append(".venv/bin/python snippet.py")
        self.output: list[str] = []

    def start(self) -> subprocess.Popen:
        up = subprocess.Popen(
            ["bash", "-c", f"exec {self.start_line}"],
            cwd=self.folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=lambda: self.output.extend(up.stdout), daemon=True).start()
        return up

    def run_rest(self, *appended: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        script = "set -e\n" + "\n".join(self.rest) + "".join(f" {a}" for a in appended) + "\n"
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("TA_", "TINKER_"))}
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=environment,
        )


def client_env(run_dir: Path) -> dict[str, str]:
    found = dict(re.findall(r"export (\w+)=(\S+)", (run_dir / "client.env").read_text()))
    return {k: v.strip("'") for k, v in found.items()}


def processes_in(folder: Path) -> list[str]:
    """Processes whose working folder is ``folder`` (what `up` and its children run in here)."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder.resolve():
                left.append((proc / "cmdline").read_text().replace("\0", " "))
        except OSError:
            continue
    return left


def stop(up: subprocess.Popen, snippet: Snippet) -> None:
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, "".join(snippet.output)[-3000:]
    wait_for(lambda: not processes_in(snippet.folder), 10, "every process of the run to end")


def test_the_remote_vector_env_snippet_runs_as_written(tmp_path: Path) -> None:
    folder = workspace(tmp_path)
    snippet = Snippet("remote-envs", folder)
    run_dir = folder / "runs" / "remote-envs"
    up = snippet.start()
    try:

        def env_services() -> int:
            if not (run_dir / "client.env").exists():
                return 0
            env = client_env(run_dir)
            password = Path(env["TA_REDIS_PASSWORD_FILE"]).read_text().strip()
            with redis.Redis.from_url(env["TA_REDIS_URL"], password=password) as client:
                return len(live_services(client, "remote-envs", "env"))

        wait_for(lambda: env_services() == 2, 120, "the run's two env services")
        done = snippet.run_rest()
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert (run_dir / "client.env").stat().st_mode & 0o777 == 0o600
    finally:
        stop(up, snippet)


def test_the_tinker_ppo_loop_snippet_runs_as_written_and_learns(tmp_path: Path) -> None:
    """The example PPO loop, written only against the tinker SDK and ``tinker_atropos.experience_source``, learns Pendulum-v1
    through our env and rollout services and the trainer's Tinker API. The test appends one thing to the snippet's
    command: a lower target (-700, from random play's -1,200: learning shown in half the time of -400)."""
    config = yaml.safe_load((REPO / "examples" / "tinker_pendulum.yaml").read_text())
    port = free_port()
    config["trainer"]["tinker"]["port"] = port  # another test may hold 8000
    folder = workspace(tmp_path, **{"tinker_pendulum.yaml": yaml.safe_dump(config)})
    snippet = Snippet("tinker-ppo-loop", folder)
    run_dir = folder / "runs" / "tinker-pendulum"
    up = snippet.start()
    try:
        wait_for(
            lambda: any("Tinker API at" in line for line in snippet.output), 120, "up to announce the API"
        )
        done = snippet.run_rest("--target-return", "-700", "--max-minutes", "5", timeout_s=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "reached -700.0" in done.stdout, done.stdout[-3000:]
        keys = run_dir / "tinker_api_keys"
        assert keys.stat().st_mode & 0o777 == 0o600
        env = client_env(run_dir)
        assert env["TINKER_BASE_URL"] == f"http://127.0.0.1:{port}"
        # the run's secrets: its Redis wants the password, its env services the token, a process without refused
        password = Path(env["TA_REDIS_PASSWORD_FILE"]).read_text().strip()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(env["TA_REDIS_URL"]).ping()
        assert not any(password in line for line in processes_in(folder))  # on no command line of the run
        with redis.Redis.from_url(env["TA_REDIS_URL"], password=password) as client:
            address = live_services(client, "tinker-pendulum", "env")[0].address
        with EnvClient(address, "grpc") as outsider, pytest.raises(grpc.RpcError) as refused:
            outsider.describe(timeout_s=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert httpx.get(f"{env['TINKER_BASE_URL']}/api/v1/healthz").status_code == 401
    finally:
        stop(up, snippet)
    assert f"Tinker API at http://127.0.0.1:{port} (TINKER_BASE_URL)" in "".join(snippet.output)
