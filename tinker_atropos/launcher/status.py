"""``tinker-atropos status``: the live services of a run and its counters, read from the Redis registry."""

from __future__ import annotations

import sys

import redis
from rich.console import Console
from rich.table import Table

from tinker_atropos.state.connection import connect_fast, describe, masked
from tinker_atropos.state.experience import queued_chunks, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

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
    ),
}


def runs_in(client: redis.Redis) -> list[str]:
    return sorted({key.decode().split(":")[1] for key in client.scan_iter(match="ta:*:service:*", count=500)})


def _figure(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def print_status(redis_url: str, run: str | None) -> int:
    """Print each run's services and counters; 1, with one line, when Redis does not answer within seconds."""
    # piped output (logs, scripts) gets full-width rows instead of wrapped, truncated cells
    console = Console() if sys.stdout.isatty() else Console(width=250)
    client = connect_fast(redis_url)
    try:
        return _print_runs(console, client, redis_url, run)
    except redis.AuthenticationError as error:  # a subclass of ConnectionError: before it
        console.print(f"[red]Redis at {masked(redis_url)} refused the login: {error}", highlight=False)
        return 1
    except redis.ConnectionError as error:
        console.print(f"[red]cannot reach Redis at {masked(redis_url)}: {describe(error)}", highlight=False)
        return 1
    except redis.RedisError as error:  # reached, and refused a command (an ACL user without a run's keys)
        hint = " (an ACL user confined to one run needs --run RUN)" if run is None else ""
        console.print(f"[red]Redis at {masked(redis_url)} refused: {error}{hint}", highlight=False)
        return 1
    finally:
        client.close()


def _policy_version(client: redis.Redis, run: str) -> str:
    try:
        return str(published_version(client, run))
    except ValueError as error:  # a malformed weights record
        return f"unreadable: {error}"


def _print_runs(console: Console, client: redis.Redis, redis_url: str, run: str | None) -> int:
    runs = [run] if run else runs_in(client)
    if not runs:
        console.print(f"no live services in {masked(redis_url)}")
        return 0
    for name in runs:
        table = Table(title=f"run {name!r}  (policy version {_policy_version(client, name)})")
        for column in (
            "kind",
            "name",
            "address",
            "incarnation",
            "restarts",
            "heartbeat age",
            "up",
            "figures",
        ):
            table.add_column(column)
        for record in live_services(client, name):
            shown = SHOWN_FIGURES.get(record.kind, tuple(record.figures))
            figures = "  ".join(f"{k}={_figure(record.figures[k])}" for k in shown if k in record.figures)
            if record.figures.get("metrics_address"):
                figures += f"  metrics=http://{record.figures['metrics_address']}/metrics"
            table.add_row(
                record.kind,
                record.name,
                record.address,
                record.incarnation,
                str(record.restarts),
                f"{record.heartbeat_age_s:.1f}s",
                f"{record.heartbeat_at - record.started_at:.0f}s",
                figures,
            )
        console.print(table)
        counters = read_stats(client, name)
        counters["chunks_queued"] = queued_chunks(client, name)
        console.print("  ".join(f"{k}={v}" for k, v in sorted(counters.items())))
    return 0
