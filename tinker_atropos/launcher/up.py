"""``tinker-atropos up``: every service as its own OS process on this machine, supervised, with progress.

Each child gets its own session and a parent-death signal, so Ctrl-C drains them through the launcher and
even a killed launcher leaves no orphan. A child that dies is restarted with backoff, up to a cap, as
Compose or Kubernetes would restart its container.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import redis
from rich.console import Console

from tinker_atropos.config import Config
from tinker_atropos.runtime import child_preexec
from tinker_atropos.state.connection import connect
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.experience import queued_chunks, read_stats, recent_episodes
from tinker_atropos.state.registry import live_services

log = logging.getLogger(__name__)

MAX_RESTARTS = 10
CHAOS_RESTART_DELAY_S = 0.5
STOP_TIMEOUT_S = 10.0
RETURN_WINDOW = 10  # episode_return_mean is over the latest this many episodes


@dataclass
class Child:
    """One supervised service process."""

    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    failures: int = 0  # unexpected exits, capped; chaos kills are expected and not counted
    killed_by_chaos: bool = False
    death_signal: int = signal.SIGTERM  # what it gets when the launcher dies (see ``child_preexec``)
    next_start: float = 0.0
    log_file: TextIO | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.log_file is None:
            self.log_file = open(self.log_path, "a")  # noqa: SIM115 - kept open for the child's life
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tinker_atropos", *self.args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(child_preexec, self.death_signal),
        )

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; killing it", self.name)
            self.process.kill()
            self.process.wait()
        if self.log_file is not None:
            self.log_file.close()


def service_children(config: Config, config_path: Path, redis_url: str, run_dir: Path) -> list[Child]:
    common = ["--config", str(config_path), "--redis-url", redis_url, "--host", "127.0.0.1", "--port", "0"]
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [("env", f"env-{i}") for i in range(config.env.services)]
    names += [("rollout", f"rollout-{i}") for i in range(config.rollout.replicas)]
    names.append(("trainer", "trainer"))
    children = []
    for kind, name in names:
        extra = ["--run-dir", str(run_dir)] if kind == "trainer" else []
        children.append(Child(name, [kind, *common, "--name", name, *extra], logs / f"{name}.log"))
    return children


class ProgressReporter:
    """Reads the run's figures from Redis, prints one line per report, appends metrics.jsonl."""

    def __init__(self, client: redis.Redis, run: str, metrics_path: Path, console: Console) -> None:
        self.client, self.run, self.console = client, run, console
        self.metrics = open(metrics_path, "a")  # noqa: SIM115 - closed by close()
        self.start = time.monotonic()
        self.last_time, self.last_steps = self.start, 0

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        stats = read_stats(self.client, self.run)
        episodes = recent_episodes(self.client, self.run, RETURN_WINDOW)
        trainers = live_services(self.client, self.run, "trainer")
        trainer = trainers[0].figures if trainers else {}
        steps = stats.get("env_steps", 0)
        row = {
            "env_steps": steps,
            "wall_time_s": round(now - self.start, 3),
            "env_steps_per_s": round((steps - self.last_steps) / max(now - self.last_time, 1e-9), 1),
            "episodes": stats.get("episodes", 0),
            "episode_return_mean": (sum(e["return"] for e in episodes) / len(episodes)) if episodes else None,
            "policy_version": int(trainer.get("policy_version", 0)),
            "trainer_busy": round(float(trainer.get("busy_fraction", 0.0)), 3),
            "policy_lag_mean": float(trainer.get("policy_lag_mean", 0.0)),
            "chunks_written": stats.get("chunks_written", 0),
            "chunks_rejected_stale": stats.get("chunks_rejected_stale", 0),
            "chunks_dropped_backpressure": stats.get("chunks_dropped_backpressure", 0),
            "chunks_queued": queued_chunks(self.client, self.run),
        }
        self.last_time, self.last_steps = now, steps
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        ret = "-" if row["episode_return_mean"] is None else f"{row['episode_return_mean']:.1f}"
        self.console.print(
            f"[bold]{steps:>10,}[/] steps  {row['env_steps_per_s']:>8,.0f} steps/s  "
            f"episodes {row['episodes']:>6}  return {ret:>8}  version {row['policy_version']:>5}  "
            f"trainer busy {row['trainer_busy']:.0%}  lag {row['policy_lag_mean']:.1f}"
        )
        return row

    def close(self) -> None:
        self.metrics.close()


def run_local(
    config: Config,
    total_steps: int | None,
    run_dir: Path,
    redis_url: str | None,
    target_return: float | None = None,
    chaos_interval_s: float | None = None,
    max_seconds: float | None = None,
) -> int:
    """Run until ``total_steps`` env steps, ``target_return`` reached, ``max_seconds`` of wall time (start-up
    included) or Ctrl-C; returns the exit code.

    With ``chaos_interval_s``, a random service process is killed (SIGKILL) that often: the run must go on.
    """
    console = Console(soft_wrap=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    console.print(f"[bold]tinker-atropos up[/] run {config.run.name!r} in {run_dir}\n{config.to_yaml()}")

    stopping = False

    def request_stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    server = None
    url = redis_url or config.redis.url
    if url is None:
        server = EmbeddedValkey(run_dir / "valkey", append_only=config.redis.append_only)
        url = server.url
        console.print(f"embedded Valkey at {url}")
    children = service_children(config, config_path, url, run_dir)
    code = 0
    reporter = None
    try:
        for child in children:
            child.start()
        reporter = ProgressReporter(connect(url), config.run.name, run_dir / "metrics.jsonl", console)
        next_report = time.monotonic() + config.run.report_interval_s
        chaos = random.Random(config.run.seed)
        next_chaos = time.monotonic() + (chaos_interval_s or 0.0)
        while not stopping:
            time.sleep(0.1)
            code = supervise(children, console)
            if code:
                break
            if chaos_interval_s and time.monotonic() >= next_chaos:
                next_chaos += chaos_interval_s
                kill_one(children, chaos, console, run_dir / "chaos.jsonl", reporter.start)
            if time.monotonic() >= next_report:
                next_report += config.run.report_interval_s
                row = reporter.report()
                if total_steps is not None and row["env_steps"] >= total_steps:
                    console.print(f"reached {total_steps:,} env steps; stopping")
                    break
                if max_seconds is not None and row["wall_time_s"] >= max_seconds:
                    console.print(f"{max_seconds:g} s of wall time spent; stopping")
                    break
                solved = row["episode_return_mean"] is not None and row["episodes"] >= RETURN_WINDOW
                if target_return is not None and solved and row["episode_return_mean"] >= target_return:
                    console.print(
                        f"mean return {row['episode_return_mean']:.1f} >= {target_return}; stopping"
                    )
                    break
    finally:
        for child in children:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.wait(deadline)
        if reporter is not None:
            reporter.close()
        if server is not None:
            server.stop()
    console.print("all services stopped")
    return code


def kill_one(
    children: list[Child], chaos: random.Random, console: Console, events: Path, clock_start: float
) -> None:
    """Chaos mode: SIGKILL one running service, as a crashed node or an OOM kill would.

    Each kill is appended to ``events`` on the clock of metrics.jsonl, so recovery can be read off both.
    """
    running = [c for c in children if c.process is not None and c.process.poll() is None]
    if running:
        victim = chaos.choice(running)
        victim.killed_by_chaos = True
        victim.process.kill()
        console.print(f"[magenta]chaos: killed {victim.name} (pid {victim.process.pid})")
        event = {
            "wall_time_s": round(time.monotonic() - clock_start, 3),
            "service": victim.name,
            "kind": victim.args[0],
            "pid": victim.process.pid,
        }
        with events.open("a") as out:
            out.write(json.dumps(event) + "\n")


def supervise(children: list[Child], console: Console) -> int:
    """Restart children that died, with exponential backoff; non-zero when one exceeded the restart cap."""
    now = time.monotonic()
    for child in children:
        process = child.process
        if process is None:
            if now >= child.next_start:
                child.start()
            continue
        if process.poll() is None:
            continue
        child.restarts += 1
        if child.killed_by_chaos:
            child.killed_by_chaos = False
            delay = CHAOS_RESTART_DELAY_S
        else:
            if child.failures >= MAX_RESTARTS:
                console.print(
                    f"[red]{child.name} exited with code {process.returncode} {MAX_RESTARTS} times; giving up"
                )
                return 1
            child.failures += 1
            delay = min(2.0 ** (child.failures - 1), 30.0)
        console.print(
            f"[yellow]{child.name} exited with code {process.returncode}; restart {child.restarts} "
            f"in {delay:.0f}s (log: {child.log_path})"
        )
        child.process, child.next_start = None, now + delay
    return 0
