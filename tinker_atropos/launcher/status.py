"""``tinker-atropos status``: the live services of a run and its counters, read from the Redis registry.

Given a run folder (or run where one is: the current folder, or the only run under ``runs/``), it reads where that
run's Redis is from the folder's lock and its password from the folder: no URL, no password to look up.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tinker_atropos.errors import FatalError
from tinker_atropos.state import keys
from tinker_atropos.state.connection import connect_fast, describe, login_refused, masked
from tinker_atropos.state.experience import queued_chunks, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.run_dir import LOCK_NAME, is_locked, read_holder
from tinker_atropos.state.weights import published_version

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60  # the sparkline's length: a minute of views at one a second
LATE_HEARTBEAT_S = 3.0  # a heartbeat older than this (every second by default) is shown as late
COLUMNS = ("kind", "name", "address", "incarnation", "restarts", "health", "heartbeat age", "up", "figures")

SHOWN_FIGURES = {
    "env": (
        "env_id",
        "instances",
        "free_instances",
        "sessions",
        "steps",
        "episodes",
        "episodes_cut_nonfinite",
        "bad_requests",
        "streams_refused",
        "streams_timed_out",
        "sessions_refused_busy",
        "sessions_taken_over",
    ),
    "rollout": (
        "policy_version",
        "env_steps",
        "chunks_written",
        "partial_chunks_dropped",
        "connected_sessions",
        "instances_held",
        "instances_by_env",
        "units_assigned",
        "weights_refused",
        "episode_return_mean",
        "sessions_lost",
        "units_handed_over",
        "leases_lost",
        "lease_records_skipped",
    ),
    "trainer": (
        "policy_version",
        "updates",
        "busy_fraction",
        "policy_lag_min",
        "policy_lag_mean",
        "policy_lag_max",
        "policy_lag_counts",
        "records_rejected",
        "updates_discarded_nonfinite",
        "tinker_events",
        "eval_policy_version",
        "eval_return_mean",
        "eval_best_policy_version",
        "eval_best_return_mean",
    ),
    "atropos_api": (
        "url",
        "step",
        "queue_groups",
        "queue_sequences",
        "envs_connected",
        "groups_received",
        "groups_refused_full",
        "groups_duplicate",
        "batches_served",
    ),
}
SHOWN_FIGURES["eval_env"] = SHOWN_FIGURES["env"]


def runs_in(client: redis.Redis) -> list[str]:
    """The runs with a service in the registry (``ta:{run}:service:…``)."""
    services = client.scan_iter(match=keys.service_pattern("*"), count=500)
    return sorted({key.decode().split(":")[1] for key in services})


def _figure(value: object) -> str:
    if isinstance(value, dict):  # a labelled figure: instances by env service, refusals by reason
        return ",".join(f"{k}:{_figure(v)}" for k, v in sorted(value.items())) or "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


DEFAULT_URL = "redis://127.0.0.1:6379/0"  # where `status` looks when neither a URL nor a run folder is given


class RunNotRunning(Exception):
    """The run folder's run has no live `up`: one line, exit code 1."""


@dataclass(frozen=True)
class RunAddress:
    """Where ``status`` reads a run: the Redis URL (with the run's password when its folder has one) and the run."""

    url: str
    run: str | None
    lost: str = ""  # why no run was found, said before why the default Redis did not answer either


def _is_run_folder(folder: Path) -> bool:
    return (folder / LOCK_NAME).exists() or (folder / "config.yaml").exists()


def find_run(run_dir: Path | None, url: str | None, here: Path) -> RunAddress:
    """The Redis and run to show: ``url`` when given; else those of ``run_dir``, or of the run folder found
    ``here`` (the folder itself, or the only run under ``here/runs`` — the only running one, if several); else
    the default URL. FatalError (one line) for a folder that is none or a choice to make, RunNotRunning for a
    run no ``up`` holds."""
    if url is not None:
        holder = read_holder(run_dir) if run_dir is not None else None
        return RunAddress(url, holder.run if holder else None)
    if run_dir is not None:
        if not run_dir.is_dir():
            raise FatalError(f"{run_dir} does not exist: pass a run folder (runs/NAME by default)")
        if not _is_run_folder(run_dir):
            raise FatalError(
                f"{run_dir} is not a run folder: it has no {LOCK_NAME} nor config.yaml (`up` writes them)"
            )
        return _run_address(run_dir)
    if _is_run_folder(here):
        return _run_address(here)
    found = sorted(d for d in (here / "runs").glob("*") if d.is_dir() and _is_run_folder(d))
    running = [d for d in found if is_locked(d)]
    if len(found) == 1 or len(running) == 1:
        return _run_address(running[0] if running else found[0])
    if found:
        names = ", ".join(d.name for d in found)
        raise FatalError(
            f"{len(found)} runs in {here / 'runs'} ({names}), {len(running)} of them running: pass "
            f"one, e.g. `tinker-atropos status {found[0]}`"
        )
    return RunAddress(DEFAULT_URL, None, f"no run here: no run folder in {here} nor under {here / 'runs'}")


def _run_address(run_dir: Path) -> RunAddress:
    holder = read_holder(run_dir)
    if not is_locked(run_dir):
        last = f"; it was held by {holder}" if holder else ""
        raise RunNotRunning(
            f"the run in {run_dir} is not running: no `up` holds it{last}. Its figures: "
            f"{run_dir / 'metrics.jsonl'} (or `tinker-atropos report {run_dir}`)"
        )
    if holder is None or not holder.redis_url:
        who = holder or "a process that did not say who it is"
        raise FatalError(
            f"the run in {run_dir} is held by {who}, which does not say where its Redis is (only "
            "`up` does): pass --redis-url"
        )
    url, password_file = holder.redis_url, run_dir / "redis-password"
    parts = urlsplit(url)
    embedded = not parts.username and parts.password is None and password_file.exists()  # its password, 0600
    if embedded:
        try:
            password = password_file.read_text().strip()
        except OSError as error:
            raise FatalError(
                f"{password_file}: {error.strerror}: run `status` as the user who ran `up`"
            ) from None
        url = urlunsplit(parts._replace(netloc=f":{quote(password, safe='')}@{parts.netloc}"))
    return RunAddress(url, holder.run or None)


def _redis_failure(error: redis.RedisError, redis_url: str, run: str | None, lost: str = "") -> str:
    """One line on why Redis did not give the figures; led by ``lost`` where no run was found: the Redis tried is
    then only the default, whose silence is not the news."""
    if lost:
        return (
            f"{lost}, and none at the default {masked(redis_url)} ({describe(error)}): pass a run folder "
            "(`tinker-atropos status RUN_DIR`) or --redis-url"
        )
    if isinstance(error, redis.AuthenticationError):  # a subclass of ConnectionError: before it
        return login_refused(redis_url, error) + "; or pass the run folder: `tinker-atropos status RUN_DIR`"
    if isinstance(error, redis.ConnectionError):
        return f"cannot reach Redis at {masked(redis_url)}: {describe(error)}"
    # reached, and refused a command (an ACL user without a run's keys)
    hint = " (an ACL user confined to one run needs --run RUN)" if run is None else ""
    return f"Redis at {masked(redis_url)} refused: {error}{hint}"


def print_status(redis_url: str, run: str | None, lost: str = "") -> int:
    """Print each run's services and counters; 1, with one line, when Redis does not answer within seconds."""
    # piped output (logs, scripts) gets full-width rows instead of wrapped, truncated cells
    console = Console() if sys.stdout.isatty() else Console(width=250)
    client = connect_fast(redis_url)
    try:
        console.print(status_view(client, redis_url, run))
        return 0
    except redis.RedisError as error:
        console.print(f"[red]{_redis_failure(error, redis_url, run, lost)}", highlight=False)
        return 1
    finally:
        client.close()


def watch_status(
    redis_url: str,
    run: str | None,
    interval_s: float = 1.0,
    frames: int | None = None,
    console: Console | None = None,
    lost: str = "",
) -> int:
    """``status --watch``: the same view redrawn every ``interval_s`` (``frames`` times, or until Ctrl-C), with
    each run's env steps/s as a sparkline of the last minute. Redis going away is a line in the view, not an exit."""
    console = console or Console()
    client = connect_fast(redis_url)
    history: dict[str, deque[tuple[float, int]]] = {}
    shown = 0
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while frames is None or shown < frames:
                try:
                    view: RenderableType = status_view(client, redis_url, run, history)
                except redis.RedisError as error:
                    view = Text(f"{_redis_failure(error, redis_url, run, lost)}; retrying", style="yellow")
                live.update(view, refresh=True)
                shown += 1
                if frames is None or shown < frames:
                    time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0


def sparkline(rates: list[float]) -> str:
    """Block characters, the highest rate a full block."""
    top = max(rates, default=0.0)
    if top <= 0:
        return SPARKS[0] * len(rates)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(rate / top * (len(SPARKS) - 1) + 0.5))] for rate in rates)


def _policy_version(client: redis.Redis, run: str) -> str:
    try:
        return str(published_version(client, run))
    except ValueError as error:  # a malformed weights record
        return f"unreadable: {error}"


def status_view(
    client: redis.Redis,
    redis_url: str,
    run: str | None,
    history: dict[str, deque[tuple[float, int]]] | None = None,
) -> RenderableType:
    """Each run's services (with their heartbeat's health) and counters; with ``history`` (watching), each run's
    env steps/s over the views so far."""
    runs = [run] if run else runs_in(client)
    if not runs:
        return Text(f"no live services in {masked(redis_url)}")
    parts: list[RenderableType] = []
    for name in runs:
        table = Table(title=f"run {name!r}  (policy version {_policy_version(client, name)})")
        for column in COLUMNS:
            table.add_column(column)
        for record in live_services(client, name):
            shown = SHOWN_FIGURES.get(record.kind, tuple(record.figures))
            figures = "  ".join(f"{k}={_figure(record.figures[k])}" for k in shown if k in record.figures)
            if record.figures.get("metrics_address"):
                figures += f"  metrics=http://{record.figures['metrics_address']}/metrics"
            late = record.heartbeat_age_s > LATE_HEARTBEAT_S
            table.add_row(
                record.kind,
                record.name,
                record.address,
                record.incarnation,
                str(record.restarts),
                "[yellow]late[/]" if late else "[green]live[/]",
                f"{record.heartbeat_age_s:.1f}s",
                f"{record.heartbeat_at - record.started_at:.0f}s",
                figures,
            )
        parts.append(table)
        counters = read_stats(client, name)
        counters["chunks_queued"] = queued_chunks(client, name)
        line = "  ".join(f"{k}={v}" for k, v in sorted(counters.items()))
        if history is not None:
            points = history.setdefault(name, deque(maxlen=SPARK_POINTS + 1))
            points.append((time.monotonic(), int(counters.get("env_steps", 0))))
            rates = [
                max(0.0, (s1 - s0) / max(t1 - t0, 1e-9)) for (t0, s0), (t1, s1) in itertools.pairwise(points)
            ]
            if rates:
                line = f"env steps/s {sparkline(rates)} {rates[-1]:,.0f}\n" + line
        parts.append(Text(line))
    return Group(*parts)
