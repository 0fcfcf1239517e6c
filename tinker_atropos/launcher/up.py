"""``tinker-atropos up``: every service as its own OS process on this machine, supervised, with progress.

Before anything starts, the env is resolved and built once (a bad one is one line and exit code 2). The
embedded Valkey is supervised like the services: restarted on the same port and data folder when it dies.
Each child gets its own session and a parent-death signal, so Ctrl-C drains them through the launcher and
even a killed launcher leaves no orphan. A re-used run folder resumes its run; ``--fresh`` starts over. The
run ends with a summary of where it got to and where its files are.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from rich.console import Console

from tinker_atropos.config import Config
from tinker_atropos.environment.envs import EnvError, check_env
from tinker_atropos.launcher.progress import RETURN_WINDOW, ProgressReporter
from tinker_atropos.launcher.run_folder import (
    PreviousRun,
    clear_run_folder,
    latest_checkpoint,
    mark_resume,
    previous_run,
)
from tinker_atropos.launcher.supervisor import Child, supervise
from tinker_atropos.runtime import EXIT_FATAL
from tinker_atropos.state import keys
from tinker_atropos.state.connection import (
    RedisUnreachable,
    connect_fast,
    describe,
    masked,
    wait_until_reachable,
)
from tinker_atropos.state.embedded import EmbeddedValkey

STOP_TIMEOUT_S = 10.0
VALKEY_RETRY_S = 1.0


@dataclass(frozen=True)
class UpOptions:
    """When ``up`` stops, besides Ctrl-C: ``total_steps`` counts the whole run (a resumed one included),
    ``max_seconds`` this invocation's wall time, start-up included."""

    total_steps: int | None = None
    target_return: float | None = None
    max_seconds: float | None = None
    fresh: bool = False
    metrics: bool = False  # every service serves Prometheus metrics on a free port (in `status`)


_LISTENERS: list[socket.socket] = []  # sockets up holds for its children's lifetime


def service_children(
    config: Config, config_path: Path, redis_url: str, run_dir: Path, metrics: bool = False
) -> list[Child]:
    """Every service of the run as a child of ``up``; the Redis URL goes by environment, since a URL with a
    password on a command line is there for any user's ``ps`` to read."""
    common = ["--config", str(config_path), "--host", "127.0.0.1", "--port", "0"]
    common += ["--metrics-port", "0"] if metrics else []
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [("env", f"env-{i}") for i in range(config.env.services)]
    names += [("rollout", f"rollout-{i}") for i in range(config.rollout.replicas)]
    names.append(("trainer", "trainer"))
    evaluation = config.trainer.evaluation
    if evaluation.every_updates:
        names.append(("env", "env-eval"))
    if config.atropos.enabled:
        names.append(("atropos-api", "atropos-api"))
    children = []
    for kind, name in names:
        extra = ["--run-dir", str(run_dir)] if kind == "trainer" else []
        if name == "env-eval":
            extra = ["--role", "eval", "--instances", str(evaluation.instances)]
        if kind == "atropos-api":
            listener = socket.create_server((config.atropos.host, config.atropos.port))
            _LISTENERS.append(listener)  # held by up for the run: a restarted API serves the same socket
            extra = ["--http-fd", str(listener.fileno())]
        child = Child(name, [kind, *common, "--name", name, *extra], logs / f"{name}.log")
        if kind == "atropos-api":
            child.pass_fds = (listener.fileno(),)
        child.environment["TA_REDIS_URL"] = redis_url
        children.append(child)
    return children + atropos_environments(config, logs)  # last: the trajectory API starts first


def atropos_environments(config: Config, logs: Path) -> list[Child]:
    """The Atropos environment programs of ``atropos.environments``, their placeholders filled in."""
    trainer = config.trainer.atropos
    values = {"python": sys.executable, "api_url": f"http://{config.atropos.host}:{config.atropos.port}",
              "inference_url": f"http://{trainer.inference_host}:{trainer.inference_port}/v1"}  # fmt: skip
    children = []
    for i, argv in enumerate(config.atropos.environments):
        filled = [arg.format(**values) for arg in argv]
        children.append(
            Child(f"atropos-env-{i}", filled[1:], logs / f"atropos-env-{i}.log", program=filled[:1])
        )
    return children


def run_secret(run_dir: Path, name: str) -> Path:
    """A secret of the run, ``<run folder>/<name>`` (mode 0600), made on first use and kept for a resume: the
    ``token`` every gRPC call between the run's services carries and that signs its records (``security``),
    the ``redis-password`` of its embedded Valkey."""
    path = run_dir / name
    if not path.exists():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_urlsafe(32) + "\n")
    return path


def _clear_redis_run(url: str, run: str) -> int:
    """Delete every key of ``run`` from a Redis that outlives runs (``--fresh`` with ``redis.url``)."""
    client = connect_fast(url)
    try:
        names = list(client.scan_iter(match=keys.run_pattern(run), count=1000))
        return int(client.delete(*names)) if names else 0
    finally:
        client.close()


class _Stop(Exception):
    """Ends the supervision loop; ``code`` is up's exit code."""

    def __init__(self, reason: str, code: int = 0) -> None:
        super().__init__(reason)
        self.reason, self.code = reason, code


def run_local(config: Config, run_dir: Path, redis_url: str | None, options: UpOptions) -> int:
    """Run until a stop condition of ``options``, Ctrl-C, or a failure; returns the exit code."""
    console = Console(soft_wrap=True)
    run = config.run.name
    console.print(f"[bold]tinker-atropos up[/] run {run!r} in {run_dir}\n{config.to_yaml()}")
    try:
        if config.env.services:  # an Atropos run has no env service: its environments are Atropos programs
            check_env(config.env)
    except EnvError as error:
        console.print(f"[red]error: {error}", highlight=False)
        return EXIT_FATAL
    if (
        config.atropos.enabled
    ):  # up holds the API's listening socket (service_children): free, before anything starts
        try:
            socket.create_server((config.atropos.host, config.atropos.port)).close()
        except OSError as error:
            console.print(f"[red]error: the Atropos trajectory API cannot bind atropos.host:atropos.port "
                          f"{config.atropos.host}:{config.atropos.port}: {error.strerror}", highlight=False)  # fmt: skip
            return EXIT_FATAL

    url = redis_url or config.redis.url
    if options.fresh:
        removed = clear_run_folder(run_dir)
        if url is not None:
            try:
                removed.append(f"{_clear_redis_run(url, run)} Redis keys")
            except redis.RedisError as error:
                console.print(
                    f"[red]--fresh cannot clear run {run!r} in Redis at {masked(url)}: {describe(error)}"
                )
                return 1
        console.print(f"--fresh: removed {', '.join(removed) or 'nothing'}")
    previous = previous_run(run_dir)
    if previous is not None:
        console.print(
            f"[bold]resuming run {run!r} at version {previous.policy_version or 0}, {previous.env_steps:,} env "
            "steps[/] (--fresh starts over)"
        )
        if options.total_steps is not None and previous.env_steps >= options.total_steps:
            console.print(f"run {run!r} already has {previous.env_steps:,} env steps (--total-steps "
                          f"{options.total_steps:,}): nothing to do")  # fmt: skip
            return 0

    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    if previous is not None:
        mark_resume(run_dir / "metrics.jsonl", run, previous)

    stopping: list[str] = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append("Ctrl-C"))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))

    server = None
    if url is None:
        password_file = run_secret(run_dir, "redis-password")
        server = EmbeddedValkey(
            run_dir / "valkey",
            append_only=config.redis.append_only,
            password=password_file.read_text().strip(),
        )
        url = server.url
        console.print(f"embedded Valkey at {url} (its password: {password_file})")
    else:
        try:
            wait_until_reachable(url, config.redis.unreachable_timeout_s)
        except RedisUnreachable as error:
            console.print(f"[red]{error}")
            return 1
    children = service_children(config, config_path, url, run_dir, options.metrics)
    for child in children:  # the run's secrets by file name, never on a command line
        if not (
            os.environ.get("TA_TOKEN_FILE") or os.environ.get("TA_TOKEN")
        ):  # else the children inherit it
            child.environment["TA_TOKEN_FILE"] = str(run_secret(run_dir, "token"))
        if server is not None:
            child.environment["TA_REDIS_PASSWORD_FILE"] = str(password_file)
    reporter = ProgressReporter(
        server.client_url if server is not None else url,
        run,
        run_dir / "metrics.jsonl",
        console,
        counters=previous.counters if previous else None,
        wall_offset_s=previous.wall_time_s if previous else 0.0,
        policy_version=(previous.policy_version or 0) if previous else 0,
    )
    reporter.total_steps, reporter.max_seconds = options.total_steps, options.max_seconds
    started = time.monotonic()
    outcome = _Stop("stopped")
    try:
        _supervise_run(config, options, children, server, reporter, stopping, started, run_dir)
    except _Stop as stop:
        outcome = stop
    finally:
        for child in children:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.wait(deadline)
        reporter.report(
            show=False
        )  # the final figures, all services stopped: the summary and a resume read them
        reporter.close()
        if server is not None:
            server.stop()
    _summary(console, config, run_dir, outcome.reason, time.monotonic() - started, reporter, previous)
    return outcome.code


def _supervise_run(
    config: Config,
    options: UpOptions,
    children: list[Child],
    server: EmbeddedValkey | None,
    reporter: ProgressReporter,
    stopping: list[str],
    started: float,
    run_dir: Path,
) -> None:
    """The loop of ``up``: supervision, progress and stop conditions, until it raises _Stop."""
    console = reporter.console
    next_report = time.monotonic() + config.run.report_interval_s
    next_valkey_start = 0.0
    tinker_announced = not config.trainer.tinker.enabled
    while not stopping:
        time.sleep(0.1)
        now = time.monotonic()
        if server is not None and server.process.poll() is not None and now >= next_valkey_start:
            console.print(f"[yellow]embedded Valkey exited with code {server.process.returncode}; restarting "
                          f"it on port {server.port} (log: {server.log_path})")  # fmt: skip
            try:
                server.restart()
                console.print("[green]embedded Valkey restarted")
            except RuntimeError as error:
                console.print(f"[yellow]{error}; retrying")
                next_valkey_start = now + VALKEY_RETRY_S
        if give_up := supervise(children, console):
            raise _Stop(give_up.reason, give_up.exit_code)
        # --total-steps is checked every tick, not every report: a fast run would overshoot by an interval's steps
        steps = reporter.env_steps() if options.total_steps is not None else None
        if now < next_report and (steps is None or steps < options.total_steps):
            continue
        next_report += config.run.report_interval_s
        row = reporter.report()
        if not tinker_announced and reporter.tinker_api:
            tinker = config.trainer.tinker
            keys_file = tinker.api_keys_file or run_dir / "tinker_api_keys"
            console.print(f"Tinker API at {reporter.tinker_api} (TINKER_BASE_URL); its API keys: {keys_file}")
            tinker_announced = True
        if reporter.outage_s() > config.redis.unreachable_timeout_s:
            raise _Stop(f"Redis unreachable for {reporter.outage_s():.0f} s (redis.unreachable_timeout_s)", 1)
        if options.max_seconds is not None and now - started >= options.max_seconds:
            raise _Stop(f"{options.max_seconds:g} s of wall time spent")
        if row is None:
            continue
        if options.total_steps is not None and row["env_steps"] >= options.total_steps:
            raise _Stop(f"reached {options.total_steps:,} env steps")
        mean, target = row["episode_return_mean"], options.target_return
        if target is not None and mean is not None and row["episodes"] >= RETURN_WINDOW and mean >= target:
            raise _Stop(f"mean return {mean:.1f} >= {target}")
    raise _Stop(stopping[0])


def _summary(
    console: Console,
    config: Config,
    run_dir: Path,
    reason: str,
    seconds: float,
    reporter: ProgressReporter,
    previous: PreviousRun | None,
) -> None:
    """Where the run got to and where its files are: the last thing `up` prints."""
    row = reporter.last_row or {}
    steps = row.get("env_steps", previous.env_steps if previous else 0)
    this_session = steps - (previous.env_steps if previous else 0)
    mean = row.get("episode_return_mean")
    checkpoint = latest_checkpoint(run_dir)
    console.print(
        f"[bold]run {config.run.name!r} stopped ({reason})[/] after {seconds:.1f} s: {steps:,} env steps "
        f"({this_session:,} in this session), policy version {row.get('policy_version', '-')}, mean return "
        f"{'-' if mean is None else f'{mean:.1f}'} (last {RETURN_WINDOW} episodes)\n"
        f"  metrics      {run_dir / 'metrics.jsonl'}\n"
        f"  logs         {run_dir / 'logs'}/\n"
        f"  checkpoints  {run_dir / 'checkpoints'}/ (latest: {checkpoint.name if checkpoint else 'none'})"
    )
