"""``tinker-atropos status``'s view and ``--watch``: each service with its heartbeat's health and its figures,
the run's counters, and while watching, the env steps/s of the last views as a sparkline."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from tinker_atropos.launcher.status import find_run, print_status, sparkline, status_view, watch_status
from tinker_atropos.state.experience import add_stats
from tinker_atropos.state.registry import Registration


def rendered(view: object) -> str:
    console = Console(file=io.StringIO(), width=250, force_terminal=False)
    console.print(view)
    return console.file.getvalue()


def test_the_view_shows_each_service_and_the_watch_adds_a_throughput_sparkline(valkey, redis_client) -> None:
    figures = {
        "env_id": "Pendulum-v1",
        "instances": 4,
        "free_instances": 0,
        "metrics_address": "127.0.0.1:9400",
    }
    registration = Registration(
        redis_client,
        "watched",
        "env",
        "127.0.0.1:50051",
        "abc123",
        lambda: figures,
        interval_s=0.1,
        ttl_s=5.0,
        name="env-0",
    )
    registration.start()
    try:
        add_stats(redis_client, "watched", env_steps=1000)
        history: dict = {}
        first = rendered(status_view(redis_client, valkey.url, "watched", history))
        assert "env-0" in first and "live" in first and "env_id=Pendulum-v1" in first
        assert "metrics=http://127.0.0.1:9400/metrics" in first and "env_steps=1000" in first
        assert "env steps/s" not in first  # one point: no rate yet
        for more in (500, 2000):
            add_stats(redis_client, "watched", env_steps=more)
            later = rendered(status_view(redis_client, valkey.url, "watched", history))
        assert "env steps/s " in later and "env_steps=3500" in later
        line = next(line for line in later.splitlines() if line.startswith("env steps/s"))
        assert line.split()[2][-1] in "▁▂▃▄▅▆▇█" and len(line.split()[2]) == 2

        screen = io.StringIO()
        watched = watch_status(
            valkey.url,
            "watched",
            interval_s=0.05,
            frames=3,
            console=Console(file=screen, width=250, force_terminal=True),
        )
        assert watched == 0 and "env-0" in screen.getvalue() and "env steps/s" in screen.getvalue()
    finally:
        registration.close()


def test_watching_a_redis_that_is_away_says_so_and_keeps_watching() -> None:
    screen = io.StringIO()
    url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert watch_status(url, "any", interval_s=0.05, frames=2, console=Console(file=screen, width=250)) == 0
    assert (
        "cannot reach Redis at redis://127.0.0.1:1/0" in screen.getvalue() and "retrying" in screen.getvalue()
    )


def test_status_where_no_run_is_says_so_first_and_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Outside a run folder the Redis tried is only the default: that there is no run here leads, not its error."""
    found = find_run(None, None, tmp_path)
    assert (found.url, found.run) == ("redis://127.0.0.1:6379/0", None)
    assert print_status("redis://127.0.0.1:1/0", None, found.lost) == 1  # the default, where nothing answers
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.startswith(
        f"no run here: no run folder in {tmp_path} nor under {tmp_path / 'runs'}, and none at "
    ), shown
    assert shown.endswith("pass a run folder (`tinker-atropos status RUN_DIR`) or --redis-url"), shown


def test_a_sparkline_scales_to_its_highest_rate() -> None:
    assert sparkline([0.0, 50.0, 100.0]) == "▁▅█"
    assert sparkline([0.0, 0.0]) == "▁▁"
