"""``tinker-atropos up``: every service as its own OS process on this machine, supervised, with progress.

Before anything starts, the env is resolved and built once (a bad one is one line and exit code 2). The
embedded Valkey is supervised like the services: restarted on the same port and data folder when it dies.
Each child gets its own session and a parent-death signal, so Ctrl-C drains them through the launcher and
even a killed launcher leaves no orphan. A re-used run folder resumes its run; ``--fresh`` starts over; a folder
another live ``up`` holds is refused (``state.run_dir``). Writes into the folder that a full or read-only disk
refuses are retried while learning goes on, for ``run.write_failure_timeout_s`` at most. The run ends with a
summary of where it got to, what went wrong on the way and where its files are.

This file is the lifecycle; the services it starts are ``services.py``'s, the files it writes for the run's
clients ``client_files.py``'s.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console

from tinker_atropos.config import Config
from tinker_atropos.environment.check import check_env
from tinker_atropos.errors import EXIT_FATAL, EnvError, FatalError
from tinker_atropos.launcher.client_files import (
    client_variables,
    run_secret,
    write_atropos_config,
    write_client_env,
)
from tinker_atropos.launcher.progress import ProgressReporter, RunWords, format_return
from tinker_atropos.launcher.run_folder import (
    PreviousRun,
    clear_run_folder,
    latest_checkpoint,
    mark_resume,
    previous_run,
)
from tinker_atropos.launcher.services import service_children, stop_children
from tinker_atropos.launcher.supervisor import Child, kill_hung, rotate_logs, supervise
from tinker_atropos.security import service_token
from tinker_atropos.state import keys
from tinker_atropos.state.connection import (
    RedisUnreachable,
    connect_fast,
    describe,
    masked,
    wait_until_reachable,
    without_password,
)
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.run_dir import OWNER_VARIABLE, RunFolderInUse, RunFolderLock, describe_os_error

VALKEY_RETRY_S = 1.0
LOG_CHECK_INTERVAL_S = 1.0  # between two looks at the size of the services' logs


@dataclass(frozen=True)
class UpOptions:
    """When ``up`` stops, besides Ctrl-C: ``total_steps`` counts the whole run (a resumed one included),
    ``max_seconds`` this invocation's wall time, start-up included: from ``began``, which the command sets first
    (the config's sizing, the env's check and Valkey's start are seconds a user waits too)."""

    total_steps: int | None = None
    target_return: float | None = None
    max_seconds: float | None = None
    fresh: bool = False
    metrics: bool = False  # every service serves Prometheus metrics on a free port (in `status`)
    insecure: bool = False  # the HTTP endpoints take no API key (TA_INSECURE for every child)
    began: float = field(default_factory=time.monotonic)  # when `up` began (time.monotonic)


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
    """Run until a stop condition of ``options``, Ctrl-C, or a failure; returns the exit code. The run folder is
    locked for the whole of it: a second ``up`` on it says who holds it and exits with EXIT_FATAL."""
    console = Console(soft_wrap=True)
    # before the resolved config: the one line is what the user must see
    failure = _config_failure(config, options.insecure)
    if failure is not None:
        console.print(f"[red]error: {' '.join(failure.split())}", highlight=False)
        return EXIT_FATAL
    lock = RunFolderLock(run_dir, "up", config.run.name)
    try:
        stale = lock.acquire()
    except RunFolderInUse as error:
        console.print(f"[red]error: {error}", highlight=False)
        return EXIT_FATAL
    except OSError as error:
        console.print(
            f"[red]error: cannot lock the run folder: {_os_failure(error, run_dir)}", highlight=False
        )
        return 1
    try:
        console.print(f"[bold]tinker-atropos up[/] run {config.run.name!r} in {run_dir}\n{config.to_yaml()}")
        if config.sizing:
            console.print(f"auto: {config.sizing}", highlight=False)
        if stale is not None:
            console.print(f"took over the run folder's lock from {stale}, which is gone")
        return _run_locked(config, run_dir, redis_url, options, console, lock)
    finally:
        lock.release()


def _config_failure(config: Config, insecure: bool) -> str | None:
    """Why the config cannot run here (a port it fixes is taken, its env does not build, an Atropos environment
    would be handed a URL without the key its endpoint asks), or None."""
    keyless = None if insecure else _keyless_environment(config)
    if keyless is not None:
        return keyless
    # checked here, or found by the service that binds it seconds into its start
    for setting, host, port in _fixed_ports(config):
        try:
            socket.create_server((host, port)).close()
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return f"{setting} {port} is in use on {host}: free it or set another"
            return f"{setting} {port} cannot be bound on {host}: {error.strerror or error}"
    try:
        if config.env.services:  # an Atropos run has no env service: its environments are Atropos programs
            check_env(config.env)
    except EnvError as error:
        return str(error)
    return None


def _fixed_ports(config: Config) -> list[tuple[str, str, int]]:
    """The ports the config fixes for the run's services to bind (0: a free one, never taken), with the field that
    sets each: the Atropos trajectory API's (up holds its socket), the Tinker API's, the inference endpoint's."""
    tinker, trainer = config.trainer.tinker, config.trainer.atropos
    ports = [
        ("atropos.port", config.atropos.host, config.atropos.port, config.atropos.enabled),
        ("trainer.tinker.port", tinker.host, tinker.port, tinker.enabled),
        ("trainer.atropos.inference_port", trainer.inference_host, trainer.inference_port, trainer.enabled),
    ]
    return [(setting, host, port) for setting, host, port, bound in ports if bound and port]


# the placeholders of an environment command that are bare URLs, and the endpoint each names
KEYLESS_URLS = {"api_url": "the trajectory API", "inference_url": "the inference endpoint"}


def _keyless_environment(config: Config) -> str | None:
    """Why an Atropos environment command would be refused by the endpoints it posts to: ``{api_url}`` and
    ``{inference_url}`` carry no key (a key on a command line is readable by every local user), so such an
    environment would exit on 401 and be restarted until up gives up."""
    for i, argv in enumerate(config.atropos.environments):
        for name, what in KEYLESS_URLS.items():
            if any(f"{{{name}}}" in arg for arg in argv):
                return (
                    f"atropos.environments[{i}] passes {{{name}}}, a URL without the key {what} asks: pass "
                    "`--config {atropos_config}` instead (an atroposlib config file, mode 0600, holding both "
                    "URLs with the run's keys), or run with --insecure"
                )
    return None


def _os_failure(error: OSError, path: Path) -> str:
    return f"{error.filename or path}: {describe_os_error(error)}"


def _run_locked(
    config: Config,
    run_dir: Path,
    redis_url: str | None,
    options: UpOptions,
    console: Console,
    lock: RunFolderLock,
) -> int:
    url = redis_url or config.redis.url
    previous, code = _fresh_or_resumed(config, run_dir, url, options, console)
    if code is not None:
        return code
    stopping: list[str] = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append("Ctrl-C"))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    try:  # what up writes before the services start: a folder that takes nothing is one line, now
        prepared = _prepare(config, run_dir, url, options, console, lock, previous)
    except _Prepared.Failed as failed:
        console.print(f"[red]error: {_os_failure(failed.error, run_dir)}", highlight=False)
        return 1
    server, url = prepared.server, prepared.url
    lock.update(without_password(url))  # where `status RUN_DIR` finds the run
    if options.insecure:
        console.print(
            "[yellow]--insecure: the run's HTTP endpoints take no API key; anyone on this machine can use them"
        )
    if server is None:
        try:
            wait_until_reachable(url, config.redis.unreachable_timeout_s)
        except RedisUnreachable as error:
            console.print(f"[red]{error}", highlight=False)
            return 1
        except FatalError as error:  # it refused the login: the password to set is named
            console.print(f"[red]error: {error}", highlight=False)
            return EXIT_FATAL
    reporter = ProgressReporter(
        server.client_url if server is not None else url,
        config.run.name,
        run_dir / "metrics.jsonl",
        console,
        counters=previous.counters if previous else None,
        wall_offset_s=previous.wall_time_s if previous else 0.0,
        policy_version=(previous.policy_version or 0) if previous else 0,
        return_window=config.run.return_window,
        words=RunWords.of(config.trainer.atropos.enabled),
    )
    reporter.total_steps, reporter.max_seconds = options.total_steps, options.max_seconds
    outcome = _Stop("stopped")
    children, client, tinker_keys = prepared.children, prepared.client, prepared.tinker_keys

    def tinker_found(tinker_url: str) -> Path:
        return write_client_env(run_dir, {**client, "TINKER_BASE_URL": tinker_url}, tinker_keys)

    try:
        _supervise_run(
            config, options, children, server, reporter, stopping, options.began, run_dir, tinker_found
        )
    except _Stop as stop:
        outcome = stop
    finally:
        stop_children(children)
        # the final figures, all services stopped: the summary and a resume read them
        reporter.report(show=False)
        reporter.close()
        if server is not None:
            server.stop()
    _summary(
        console,
        config,
        run_dir,
        outcome.reason,
        time.monotonic() - options.began,
        reporter,
        previous,
        children,
    )
    return outcome.code


def _fresh_or_resumed(
    config: Config, run_dir: Path, url: str | None, options: UpOptions, console: Console
) -> tuple[PreviousRun | None, int | None]:
    """``--fresh``: the folder and the run's Redis keys cleared; else what an earlier run left to resume. And the
    exit code when there is nothing to run (Redis cannot be cleared, the steps asked for are done)."""
    run = config.run.name
    if options.fresh:
        removed = clear_run_folder(run_dir)
        if url is not None:
            try:
                removed.append(f"{_clear_redis_run(url, run)} Redis keys")
            except redis.RedisError as error:
                console.print(
                    f"[red]--fresh cannot clear run {run!r} in Redis at {masked(url)}: {describe(error)}"
                )
                return None, 1
        console.print(f"--fresh: removed {', '.join(removed) or 'nothing'}")
    previous = previous_run(run_dir)
    if previous is not None:
        console.print(
            f"[bold]resuming run {run!r} at version {previous.policy_version or 0}, {previous.env_steps:,} env "
            "steps[/] (--fresh starts over)"
        )
        if options.total_steps is not None and previous.env_steps >= options.total_steps:
            console.print(
                f"run {run!r} already has {previous.env_steps:,} env steps (--total-steps "
                f"{options.total_steps:,}): nothing to do"
            )
            return previous, 0
    return previous, None


@dataclass
class _Prepared:
    """What ``up`` wrote and started before the services: the embedded Valkey (None with a given Redis), the
    Redis URL, the services to start with their environment, and what clients read (``client.env``)."""

    server: EmbeddedValkey | None
    url: str
    children: list[Child]
    client: dict[str, str]
    tinker_keys: Path | None

    class Failed(Exception):
        def __init__(self, error: OSError) -> None:
            super().__init__(str(error))
            self.error = error


def _prepare(
    config: Config,
    run_dir: Path,
    url: str | None,
    options: UpOptions,
    console: Console,
    lock: RunFolderLock,
    previous: PreviousRun | None,
) -> _Prepared:
    """Write the resolved config, start the embedded Valkey if no Redis is given, give each service its secrets by
    file name (never on a command line), write the Atropos environments' config and ``client.env``.
    ``_Prepared.Failed`` (the embedded Valkey stopped) when the folder takes nothing."""
    server, password_file = None, None
    try:
        config_path = run_dir / "config.yaml"
        config_path.write_text(config.to_yaml())
        if previous is not None:
            mark_resume(run_dir / "metrics.jsonl", config.run.name, previous)
        if url is None:
            password_file = run_secret(run_dir, "redis-password")
            server = EmbeddedValkey(
                run_dir / "valkey",
                append_only=config.redis.append_only,
                password=password_file.read_text().strip(),
            )
            url = server.url
            console.print(f"embedded Valkey at {url} (its password: {password_file})")
        children = service_children(config, config_path, url, run_dir, options.metrics)
        for child in children:
            # else the children inherit it
            if not (os.environ.get("TA_TOKEN_FILE") or os.environ.get("TA_TOKEN")):
                child.environment["TA_TOKEN_FILE"] = str(run_secret(run_dir, "token"))
            if password_file is not None:
                child.environment["TA_REDIS_PASSWORD_FILE"] = str(password_file)
            child.environment[OWNER_VARIABLE] = lock.holder.id  # checked before they write in the folder
            if options.insecure:
                child.environment["TA_INSECURE"] = "1"
        if config.atropos.environments:
            insecure = options.insecure
            token = (
                None if insecure else (service_token() or run_secret(run_dir, "token").read_text().strip())
            )
            write_atropos_config(config, run_dir, token)
        client, tinker_keys = client_variables(config, run_dir, url, password_file, options.insecure)
        write_client_env(run_dir, client, tinker_keys)
    except OSError as error:
        if server is not None:
            server.stop()
        raise _Prepared.Failed(error) from None
    return _Prepared(server, url, children, client, tinker_keys)


def _supervise_run(
    config: Config,
    options: UpOptions,
    children: list[Child],
    server: EmbeddedValkey | None,
    reporter: ProgressReporter,
    stopping: list[str],
    started: float,
    run_dir: Path,
    tinker_found: Callable[[str], object],
) -> None:
    """The loop of ``up``: supervision, progress and stop conditions, until it raises _Stop. ``tinker_found``
    gets the Tinker API's URL once the trainer serves it."""
    console = reporter.console
    next_report = time.monotonic() + config.run.report_interval_s
    next_valkey_start = 0.0
    next_rotation = 0.0
    tinker_announced = not config.trainer.tinker.enabled
    while not stopping:
        time.sleep(0.1)
        now = time.monotonic()
        if server is not None and server.process.poll() is not None and now >= next_valkey_start:
            console.print(
                f"[yellow]embedded Valkey exited with code {server.process.returncode}; restarting "
                f"it on port {server.port} (log: {server.log_path})"
            )
            try:
                server.restart()
                console.print("[green]embedded Valkey restarted")
            except RuntimeError as error:
                console.print(f"[yellow]{error}; retrying")
                next_valkey_start = now + VALKEY_RETRY_S
        if give_up := supervise(children, console):
            raise _Stop(give_up.reason, give_up.exit_code)
        if now >= next_rotation:
            rotate_logs(children, config.run.log_max_bytes, config.run.log_backups)
            next_rotation = now + LOG_CHECK_INTERVAL_S
        # --total-steps is checked every tick, not every report: a fast run would overshoot by an interval's steps
        steps = reporter.env_steps() if options.total_steps is not None else None
        if now < next_report and (steps is None or steps < options.total_steps):
            continue
        next_report += config.run.report_interval_s
        row = reporter.report()
        if row is not None:
            kill_hung(
                children, reporter.heartbeats, reporter.answering_since, config.run.hang_timeout_s, console
            )
        if not tinker_announced and reporter.tinker_api:
            tinker = config.trainer.tinker
            keys_file = tinker.api_keys_file or run_dir / "tinker_api_keys"
            console.print(f"Tinker API at {reporter.tinker_api} (TINKER_BASE_URL); its API keys: {keys_file}")
            tinker_found(reporter.tinker_api)
            tinker_announced = True
        if reporter.outage_s() > config.redis.unreachable_timeout_s:
            raise _Stop(f"Redis unreachable for {reporter.outage_s():.0f} s (redis.unreachable_timeout_s)", 1)
        failure, failing_s = reporter.write_failure()
        if failing_s > config.run.write_failure_timeout_s:
            raise _Stop(f"cannot write {failure} for {failing_s:.0f} s (run.write_failure_timeout_s)", 1)
        if options.max_seconds is not None and now - started >= options.max_seconds:
            raise _Stop(f"{options.max_seconds:g} s of wall time spent")
        if row is None:
            continue
        if options.total_steps is not None and row["env_steps"] >= options.total_steps:
            raise _Stop(f"reached {options.total_steps:,} env steps")
        mean, target = row["episode_return_mean"], options.target_return
        if (
            target is not None
            and mean is not None
            and row["episodes"] >= config.run.return_window
            and mean >= target
        ):
            raise _Stop(f"mean {reporter.words.ret} {format_return(mean)} >= {target}")
    raise _Stop(stopping[0])


def _summary(
    console: Console,
    config: Config,
    run_dir: Path,
    reason: str,
    seconds: float,
    reporter: ProgressReporter,
    previous: PreviousRun | None,
    children: list[Child],
) -> None:
    """Where the run got to, at what overall rate, what went wrong on the way and where its files are (the Tinker
    clients' checkpoints too): the last thing `up` prints, in the run's words."""
    row, words = reporter.last_row or {}, reporter.words
    steps = row.get("env_steps", previous.env_steps if previous else 0)
    this_session = steps - (previous.env_steps if previous else 0)
    mean = row.get("episode_return_mean")
    checkpoint = latest_checkpoint(run_dir)
    restarts = ", ".join(f"{c.name} {c.restarts}" for c in children if c.restarts) or "none"
    where, latest = run_dir / "checkpoints", checkpoint.name if checkpoint else "none"
    if config.trainer.atropos.enabled:  # its model, optimizer and step (in one state.pt, by earlier versions)
        where = run_dir / "atropos"
        found = latest_checkpoint(run_dir, "atropos") or next(where.glob("state.pt"), None)
        latest = found.name if found else "none"
    loop = config.trainer.experience_loop or config.trainer.atropos.enabled
    saved = [f"  checkpoints  {where}/ (latest: {latest})"] if loop else []
    if config.trainer.tinker.enabled:
        saved.append(f"  {'tinker' if loop else 'checkpoints':<11}  {_tinker_checkpoints(config, run_dir)}")
    console.print(
        f"[bold]run {config.run.name!r} stopped ({reason})[/] after {seconds:.1f} s: {steps:,} {words.steps} "
        f"({this_session:,} in this session), policy version {row.get('policy_version', '-')}, mean {words.ret} "
        f"{format_return(mean)} ({words.window(config.run.return_window)})\n"
        f"  throughput   {this_session / max(seconds, 1e-9):,.1f} {words.steps}/s over this session\n"
        f"  restarts     {restarts}\n"
        f"  problems     {_incidents(reporter.incidents()) or 'none counted'}\n"
        f"  metrics      {run_dir / 'metrics.jsonl'}\n"
        f"  logs         {run_dir / 'logs'}/\n" + "\n".join(saved),
        highlight=False,
    )


def _tinker_checkpoints(config: Config, run_dir: Path) -> str:
    """Where the Tinker clients' checkpoints are, how many they saved (``save_state``'s, sampler weights too; not
    the unnamed ones sampling clients were made with) and the latest."""
    # here, not at the top: the Tinker API's package imports torch and the SDK, seconds of every `up`'s start
    from tinker_atropos.tinker_api.store.files import EPHEMERAL, KINDS

    tinker = config.trainer.tinker
    root = Path(tinker.checkpoint_dir) if tinker.checkpoint_dir else run_dir / "tinker"
    files = root.glob("*/*/*.pt")  # <model>/<kind>/<name>.pt
    saved = [f for f in files if f.parent.name in KINDS and not f.name.startswith(EPHEMERAL)]
    latest = max(saved, key=lambda f: f.stat().st_mtime, default=None)
    return (
        f"{root}/ ({f'{len(saved)} saved, latest: {latest.relative_to(root)}' if latest else 'none saved'})"
    )


def _incidents(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items()))
