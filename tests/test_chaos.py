"""Chaos mode leaves a record of each kill on the metrics' clock, and recovery is read off the two files."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for
from tests.support.running import start_up
from tests.test_supervision import child_pids
from tinker_atropos.bench.chaos import recovery_summary, recovery_times

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
def test_up_in_chaos_mode_records_each_kill_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    chaos_log = run_dir / "chaos.jsonl"
    up = start_up(REPO / "configs" / "pendulum.yaml", run_dir, "--chaos-interval", str(CHAOS_INTERVAL_S))
    seen: set[int] = set()  # every service pid, restarted ones included

    def kills() -> int:
        seen.update(child_pids(up.pid))
        return len(chaos_log.read_text().splitlines()) if chaos_log.exists() else 0

    try:
        wait_for(lambda: kills() >= 2, 30, "two chaos kills")
        wait_for(lambda: kills() and len(child_pids(up.pid)) == 4, 10, "the last victim to be restarted")
    finally:
        up.send_signal(signal.SIGINT)
        output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    events = [json.loads(line) for line in chaos_log.read_text().splitlines()]
    assert events[0]["wall_time_s"] == pytest.approx(CHAOS_INTERVAL_S, abs=1.0)  # metrics' clock origin
    for event in events:
        assert event["service"] in {"env-0", "rollout-0", "trainer"}
        assert event["kind"] == event["service"].split("-")[0]
        assert event["pid"] in seen
        assert f"chaos: killed {event['service']} (pid {event['pid']})" in output
    alive = [pid for pid in seen if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left behind: {alive}"
