"""Service processes as the tests start, watch and stop them: as OS processes, through /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from tests.support.running import REPO
from tinker_atropos.processes import child_preexec


class Processes:
    """Service processes started by a test; all stopped (then killed) at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []

    def start(self, *args: str, name: str, stdin: int | IO[bytes] = subprocess.DEVNULL) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - inherited by the child
        process = subprocess.Popen(
            [sys.executable, "-m", "tinker_atropos", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
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


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent``, read from /proc: the services and the embedded Valkey."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children
