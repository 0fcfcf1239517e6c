"""Shared fixtures: a real Valkey server per test module and helpers to run services as OS processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from tinker_atropos.runtime import child_preexec
from tinker_atropos.state.embedded import EmbeddedValkey

REPO = Path(__file__).resolve().parents[1]

# make test runs on two xdist workers (Makefile), one per core: torch's intra-op threads in a worker
# (SB3 learning in the test process, tensors checked by hand) would only fight the other worker for the cores.
# The examples a test spawns inherit the same limit (services set theirs from the config): a CleanRL loop on
# two spinning OpenMP threads beside the other worker ran 4x slower than on one.
torch.set_num_threads(1)
for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")


@pytest.fixture(scope="session", autouse=True)
def temporary_folders_under_pytests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Libraries that make temporary folders of their own and leave them (SB3's logger, wandb's media staging)
    make them under pytest's base folder, which pytest prunes, not in the machine's /tmp: in this process
    (``tempfile.tempdir``) and in every process a test starts (``TMPDIR``)."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = folder, folder
    yield
    tempfile.tempdir = before[0]
    if before[1] is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before[1]


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture
def redis_client(valkey: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(valkey.url)
    client.flushall()
    yield client
    client.close()


class Processes:
    """Service processes started by a test; all stopped (then killed) at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []

    def start(self, *args: str, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - inherited by the child
        process = subprocess.Popen(
            [sys.executable, "-m", "tinker_atropos", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_preexec,
            cwd=REPO,
        )
        log.close()
        self.started.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 15
        for process in self.started:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``condition`` until it returns a truthy value; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def process_state(pid: int, thread: int | None = None) -> str | None:
    """The state letter /proc gives a process or one of its threads (T: stopped, Z: zombie), None once gone."""
    path = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    try:
        return path.read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped.

    The kernel stops a multi-threaded process only once one of its threads takes the signal and tells the
    others: until then a thread woken by a socket can still answer. A test of what a stopped service does must
    wait for the stop."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = (process_state(pid, int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir())
        return all(state is None or state in "Tt" for state in states)  # None: a thread that ended meanwhile

    wait_for(all_stopped, 10, f"every thread of process {pid} to stop", interval_s=0.01)
