"""``tinker-atropos status``: the live services of a run and its counters, read from the Redis registry."""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tinker_atropos.state.connection import connect_fast, describe, masked
from tinker_atropos.state.experience import queued_chunks, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60  # the sparkline's length: a minute of views at one a second
LATE_HEARTBEAT_S = 3.0  # a heartbeat older than this (every second by default) is shown as late

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
    ),
    "rollout": (
        "policy_version",
        "env_steps",
        "chunks_written",
        "partial_chunks_dropped",
        "connected_sessions",
        "weights_rejected",
        "episode_return_mean",
        "sessions_lost",
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
        "eval_policy_version",
        "eval_return_mean",
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
    return sorted({key.decode().split(":")[1] for key in client.scan_iter(match="ta:*:service:*", count=500)})


def _figure(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _redis_failure(error: redis.RedisError, redis_url: str, run: str | None) -> str:
    """One line on why Redis did not give the figures."""
    if isinstance(error, redis.AuthenticationError):  # a subclass of ConnectionError: before it
        return f"Redis at {masked(redis_url)} refused the login: {error}"
    if isinstance(error, redis.ConnectionError):
        return f"cannot reach Redis at {masked(redis_url)}: {describe(error)}"
    # reached, and refused a command (an ACL user without a run's keys)
    hint = " (an ACL user confined to one run needs --run RUN)" if run is None else ""
    return f"Redis at {masked(redis_url)} refused: {error}{hint}"


def print_status(redis_url: str, run: str | None) -> int:
    """Print each run's services and counters; 1, with one line, when Redis does not answer within seconds."""
    # piped output (logs, scripts) gets full-width rows instead of wrapped, truncated cells
    console = Console() if sys.stdout.isatty() else Console(width=250)
    client = connect_fast(redis_url)
    try:
        console.print(status_view(client, redis_url, run))
        return 0
    except redis.RedisError as error:
        console.print(f"[red]{_redis_failure(error, redis_url, run)}", highlight=False)
        return 1
    finally:
        client.close()


def watch_status(
    redis_url: str,
    run: str | None,
    interval_s: float = 1.0,
    frames: int | None = None,
    console: Console | None = None,
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
                    view = Text(f"{_redis_failure(error, redis_url, run)}; retrying", style="yellow")
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
        for column in ("kind", "name", "address", "incarnation", "restarts", "health", "heartbeat age", "up",
                       "figures"):  # fmt: skip
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
