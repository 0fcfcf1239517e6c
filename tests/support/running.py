"""Running `tinker-atropos` as a user does, from the tests: configs on disk, `up` as a process, its metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def config_file(directory: Path, base: str = "pendulum.yaml", **sections: dict[str, Any]) -> Path:
    """``configs/BASE`` with the given sections updated, written to ``directory/run.yaml``."""
    config = yaml.safe_load((REPO / "configs" / base).read_text())
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """``tinker-atropos ARGS`` in this process, as ``cli`` answers: for a command whose output is its own (a
    refusal, an export), where a process of its own would import torch and the rest again for each call."""
    from typer.testing import CliRunner

    from tinker_atropos.launcher.cli import app

    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def cli(
    *args: str, timeout: float = 120, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``tinker-atropos ARGS`` from the repository (so ``tests.support`` imports), output captured; ``env`` is
    added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "tinker_atropos", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **env} if env else None,
    )


def start_up(config: Path, run_dir: Path, *options: str) -> subprocess.Popen:
    """``tinker-atropos up`` in the background, stdout and stderr merged into a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "tinker_atropos", "up", str(config), "--run-dir", str(run_dir), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )


def stop_up(up: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to a running ``up`` (its drain), then a kill if it outlives ``timeout``."""
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout=timeout)
    finally:
        if up.poll() is None:
            up.kill()


@dataclass
class RunningUp:
    """A running ``up`` of an Atropos config, its ports the test's own, its console collected as it goes."""

    config: dict[str, Any]
    run_dir: Path
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)


@contextmanager
def atropos_up(
    directory: Path,
    base: str,
    max_seconds: int,
    report_interval_s: float,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[RunningUp]:
    """``up`` of ``configs/BASE`` (an Atropos config, changed by ``edit``) on free ports, reporting every
    ``report_interval_s``; stopped (SIGTERM, its drain) when the block ends, its console read to the end."""
    from tinker_atropos.processes import free_port

    config = yaml.safe_load((REPO / "configs" / base).read_text())
    config["atropos"]["port"] = free_port()
    config["trainer"]["atropos"]["inference_port"] = free_port()
    config["run"]["report_interval_s"] = report_interval_s
    if edit is not None:
        edit(config)
    (directory / "run.yaml").write_text(yaml.safe_dump(config))
    run = RunningUp(
        config,
        directory / "run",
        start_up(directory / "run.yaml", directory / "run", "--max-seconds", str(max_seconds)),
    )
    reader = threading.Thread(target=lambda: run.lines.extend(run.process.stdout), daemon=True)
    reader.start()
    try:
        yield run
    finally:
        stop_up(run.process)
        reader.join(timeout=5)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of the run's metrics.jsonl: report rows and resume markers."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def report_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [row for row in metrics(run_dir) if "event" not in row]


METRIC_KEYS = {
    "env_steps",
    "wall_time_s",
    "env_steps_per_s",
    "episode_return_mean",
    "policy_version",
    "trainer_busy",
}


def assert_learned(rows: list[dict], random_below: float, target: float, budget: int) -> None:
    """A run of `up --target-return TARGET` that started near random play and reached TARGET within BUDGET."""
    assert rows and all(row.keys() >= METRIC_KEYS for row in rows)
    returns = [r["episode_return_mean"] for r in rows if r["episode_return_mean"] is not None]
    assert returns[0] < random_below, f"the first episodes should be near random play, got {returns[0]}"
    # the row that stopped the run, not the final one: that is read once every service stopped, and episodes
    # that ended between the two may move its mean either way
    reached = [r for r in rows if r["episode_return_mean"] is not None and r["episode_return_mean"] >= target]
    assert reached and reached[0]["env_steps"] <= budget, (
        f"did not reach {target} within {budget} steps: {returns}"
    )
    final = rows[-1]
    assert final["env_steps"] <= budget + 20_000
    assert final["policy_version"] > 0
    assert [r["env_steps"] for r in rows] == sorted(r["env_steps"] for r in rows)


def leftovers(run_dir: Path) -> str:
    """Processes still running with ``run_dir`` on their command line."""
    return subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout


class Sidecar(threading.Thread):
    """Work done beside a running `up`, every ``interval_s``, until the run ends (see ``run_up_with``); a sidecar
    that sets ``done`` can end the run itself."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.stop, self.done = interval_s, threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.work()

    def work(self) -> None:
        raise NotImplementedError


def run_up_with(
    sidecar: Sidecar,
    config: Path,
    run_dir: Path,
    *options: str,
    timeout: float = 600,
    until_done: bool = False,
) -> str:
    """``up`` to its end with ``sidecar`` working beside it (``until_done``: until the sidecar is done, then
    SIGTERM); its output, once it exited 0 leaving nothing."""
    up = start_up(config, run_dir, *options)
    sidecar.start()
    try:
        if until_done:
            sidecar.done.wait(timeout)
            up.send_signal(signal.SIGTERM)
        output = up.communicate(timeout=timeout)[0]
    finally:
        sidecar.stop.set()
        sidecar.join()
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, output[-3000:]
    assert leftovers(run_dir) == "", "processes left behind"
    return output
