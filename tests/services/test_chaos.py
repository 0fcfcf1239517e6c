"""Chaos mode leaves a record of each kill on the metrics' clock, and recovery is read off the two files."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from bench.chaos import ChaosMonkey, on_metrics_clock, recovery_summary, recovery_times
from tests.support.processes import child_pids, wait_for
from tests.support.running import REPO, start_up

CHAOS_INTERVAL_S = 2.0


def row(t: float, steps: int, version: int) -> dict:
    return {"wall_time_s": t, "env_steps": steps, "policy_version": version}


def test_recovery_counts_from_the_first_report_after_the_kill_until_steps_and_version_both_rise() -> None:
    rows = [
        row(0.5, 1000, 1),
        row(1.0, 2000, 2),
        row(1.5, 2500, 0),  # the killed trainer has left the registry: 0 is not its version
        row(2.0, 3000, 1),  # steps rise, the version not past 2 (a resumed, older checkpoint): not recovered
        row(2.5, 3000, 3),
    ]
    events = [
        {"wall_time_s": 0.2, "service": "env-0", "kind": "env", "pid": 11},  # before the first row
        {"wall_time_s": 1.2, "service": "trainer", "kind": "trainer", "pid": 12},
        {"wall_time_s": 2.6, "service": "env-0", "kind": "env", "pid": 13},  # the run ends first
    ]

    records = recovery_times(rows, events)

    assert [r["recovery_s"] for r in records] == [pytest.approx(0.8), pytest.approx(1.3), None]
    assert (records[1]["env_steps"], records[1]["policy_version"]) == (2500, 2)
    assert records[1]["service"] == "trainer" and records[1]["pid"] == 12
    assert recovery_summary(records) == {
        "env": {
            "kills": 2,
            "not_recovered": 1,
            "median_s": pytest.approx(0.8),
            "worst_s": pytest.approx(0.8),
        },
        "rollout": {"kills": 0, "not_recovered": 0, "median_s": None, "worst_s": None},
        "trainer": {
            "kills": 1,
            "not_recovered": 0,
            "median_s": pytest.approx(1.3),
            "worst_s": pytest.approx(1.3),
        },
    }


@pytest.mark.integration
def test_a_chaos_monkey_beside_up_kills_services_it_finds_and_each_kill_lines_up_with_the_metrics(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    events_path = tmp_path / "chaos.jsonl"
    up = start_up(REPO / "configs" / "pendulum.yaml", run_dir)
    monkey = ChaosMonkey(run_dir, CHAOS_INTERVAL_S, events_path, seed=1)
    seen: set[int] = set()  # every service pid, restarted ones included

    def kills() -> int:
        seen.update(child_pids(up.pid))
        return len(events_path.read_text().splitlines()) if events_path.exists() else 0

    monkey.start()
    try:
        wait_for(lambda: kills() >= 2, 30, "two chaos kills")
        monkey.stop.set()
        wait_for(lambda: kills() and len(child_pids(up.pid)) == 4, 10, "the last victim to be restarted")
    finally:
        monkey.stop.set()
        up.send_signal(signal.SIGINT)
        output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for event in on_metrics_clock(events, rows):
        assert event["service"] in {"env-0", "rollout-0", "trainer"}
        assert event["kind"] == event["service"].split("-")[0]
        assert event["pid"] in seen
        assert f"{event['service']} exited with code -9; restart" in output  # `up` saw an ordinary crash
        assert rows[0]["wall_time_s"] - 5 < event["wall_time_s"] < rows[-1]["wall_time_s"] + 5
    alive = [pid for pid in seen if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left behind: {alive}"
