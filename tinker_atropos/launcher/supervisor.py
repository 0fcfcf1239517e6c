"""Supervision of ``up``'s service processes, as Compose or Kubernetes restart containers.

A child that dies is restarted with exponential backoff. Its restart budget decays: after ``HEALTHY_AFTER_S``
of running it starts again from a clean slate (as Kubernetes resets its crash-loop backoff), so rare crashes
never add up to giving up on a run; ``MAX_RESTARTS`` failures in a row do. A child that exits with EXIT_FATAL
(a bad env, a diverged training run) is not restarted: the run stops. Whenever a child is restarted or given
up on, the console shows the last lines of its log. A child whose process runs but whose heartbeat has gone from
the registry (hung, or stopped) is killed, and so restarted (``kill_hung``). Logs are rotated by size
(``rotate_logs``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.markup import escape

from tinker_atropos.errors import EXIT_FATAL
from tinker_atropos.processes import child_preexec

MAX_RESTARTS = 10
HEALTHY_AFTER_S = 60.0
BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0  # the delay before restart k of a crash loop: BACKOFF_S * 2 ** (k - 1)
TAIL_LINES = 6


@dataclass
class Child:
    """One supervised process: ``tinker-atropos ARGS`` unless ``program`` says otherwise."""

    name: str
    args: list[str]
    log_path: Path
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "tinker_atropos"])
    process: subprocess.Popen | None = None
    restarts: int = 0
    failures: int = 0  # exits since it last ran healthy
    death_signal: int = signal.SIGTERM  # what it gets when the launcher dies (see ``child_preexec``)
    started_at: float = 0.0
    next_start: float = 0.0
    log_file: TextIO | None = field(default=None, repr=False)
    environment: dict[str, str] = field(default_factory=dict)  # added to the launcher's own
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (a listening socket that outlives it)

    def start(self) -> None:
        if self.log_file is None:
            self.log_file = open(self.log_path, "a")  # noqa: SIM115 - kept open for the child's life
        self.process = subprocess.Popen(
            [*self.program, *self.args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(child_preexec, self.death_signal),
            env={**os.environ, **self.environment} if self.environment else None,
            pass_fds=self.pass_fds,
        )
        self.started_at = time.monotonic()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_file is not None:
            self.log_file.close()


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last non-empty lines of a log, for the console."""
    try:
        with open(path, errors="replace") as log:
            return [line.rstrip() for line in deque((x for x in log if x.strip()), maxlen=lines)]
    except OSError:
        return []


def _print_tail(console: Console, child: Child) -> None:
    for line in log_tail(child.log_path):
        console.print(f"    {escape(line)}", style="dim", highlight=False)


def rotate_logs(children: list[Child], max_bytes: int, backups: int) -> None:
    """Rotate each log past ``max_bytes``: NAME.log to NAME.log.1 (the older ones one up, ``backups`` kept).

    Copy, then truncate, as logrotate's ``copytruncate``: the child keeps its descriptor, opened for appending,
    so its next line goes to the start of the emptied file; a line written between the copy and the truncation
    (microseconds) is lost. A disk too full for the copy still gets the log truncated: a bounded log is the
    promise, and the space is what the run's checkpoints need."""
    for child in children:
        path = child.log_path
        try:
            if path.stat().st_size < max_bytes:
                continue
        except OSError:
            continue
        rotated = [path.with_name(f"{path.name}.{i}") for i in range(1, backups + 1)]
        with contextlib.suppress(OSError):
            for older, newer in zip(reversed(rotated[:-1]), reversed(rotated[1:]), strict=True):
                if older.exists():
                    older.replace(newer)
            shutil.copyfile(path, rotated[0])
        with contextlib.suppress(OSError):
            os.truncate(path, 0)


@dataclass(frozen=True)
class GiveUp:
    """Why supervision stops the run, and the exit code it ends with."""

    reason: str
    exit_code: int


def supervise(children: list[Child], console: Console) -> GiveUp | None:
    """Start due children, restart dead ones with backoff; why the run must stop, or None."""
    now = time.monotonic()
    for child in children:
        process = child.process
        if process is None:
            if now >= child.next_start:
                child.start()
            continue
        if process.poll() is None:
            if child.failures and now - child.started_at >= HEALTHY_AFTER_S:
                child.failures = 0  # healthy for a while: a later crash starts a fresh budget
            continue
        code = process.returncode
        if code == EXIT_FATAL:
            console.print(
                f"[red]{child.name} stopped with an error a restart cannot fix (log: {child.log_path}):"
            )
            _print_tail(console, child)
            return GiveUp(f"{child.name} failed", EXIT_FATAL)
        if child.failures >= MAX_RESTARTS:
            console.print(
                f"[red]{child.name} exited with code {code} {MAX_RESTARTS} times in a row; giving up "
                f"(log: {child.log_path}):"
            )
            _print_tail(console, child)
            return GiveUp(f"{child.name} kept crashing", 1)
        child.failures += 1
        delay = min(BACKOFF_S * 2.0 ** (child.failures - 1), MAX_BACKOFF_S)
        child.restarts += 1
        console.print(
            f"[yellow]{child.name} exited with code {code}; restart {child.restarts} in {delay:.1f}s "
            f"(log: {child.log_path})"
        )
        if code > 0:  # a crash, not a kill by a signal: its own last words say why
            _print_tail(console, child)
        child.process, child.next_start = None, now + delay
    return None


def kill_hung(
    children: list[Child],
    heartbeats: dict[str, float],
    answering_since: float,
    timeout_s: float,
    console: Console,
) -> None:
    """Kill each child whose process runs but whose heartbeat the registry has not shown for ``timeout_s``
    (``heartbeats``: a service's name -> when it was last seen): a deadlock or a SIGSTOP, which no exit code
    reports; ``supervise`` then restarts it as a crashed one. A child not yet seen since its start is starting
    (a Tinker trainer may load a model first), and silence while Redis did not answer (until
    ``answering_since``) is not the child's."""
    now = time.monotonic()
    for child in children:
        seen = heartbeats.get(child.name)
        if (
            child.process is None
            or child.process.poll() is not None
            or seen is None
            or seen < child.started_at
        ):
            continue
        silent_s = now - max(seen, answering_since)
        if silent_s > timeout_s:
            console.print(
                f"[yellow]{child.name} has shown no heartbeat for {silent_s:.0f} s though its process runs (hung "
                f"or stopped); killing it to restart it (run.hang_timeout_s; log: {child.log_path})"
            )
            child.process.kill()
