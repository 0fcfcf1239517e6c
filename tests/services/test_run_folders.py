"""A re-used run folder resumes its run explicitly and counts on, without an alarm about its counters; `--fresh`
starts over; `up` ends with a summary of where the run got to, what went wrong and where its files are; TensorBoard
holds every episode of the run, those of the chunks still queued when it stopped included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.running import cli, config_file, leftovers, metrics, report_rows

pytestmark = pytest.mark.integration


def up(config: Path, run_dir: Path, *options: str):
    result = cli("up", str(config), "--run-dir", str(run_dir), *options, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert leftovers(run_dir) == ""
    return result.stdout


def test_a_reused_run_folder_resumes_and_fresh_starts_over(tmp_path: Path) -> None:
    config, run_dir = config_file(tmp_path), tmp_path / "run"
    first = up(config, run_dir, "--total-steps", "8000")
    assert "resuming" not in first
    summary = first[first.index("run 'pendulum' stopped (reached 8,000 env steps)") :]
    for place in (
        "restarts     none",
        "problems     none counted",
        "metrics.jsonl",
        "logs/",
        "checkpoints/ (latest: checkpoint-",
    ):
        assert place in summary, summary
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    episodes = report_rows(run_dir)[-1]["episodes"]  # the final row: every service stopped
    assert len(events.Scalars("charts/episodic_return")) == episodes > 0
    done = report_rows(run_dir)[-1]["env_steps"]
    checkpoint = max((run_dir / "checkpoints").glob("checkpoint-*.pt")).name
    version = int(re.search(r"checkpoint-(\d+)", checkpoint).group(1))

    second = up(config, run_dir, "--total-steps", str(done + 8000))
    assert f"resuming run 'pendulum' at version {version}, {done:,} env steps" in second
    assert "went back" not in second  # the new Redis starts at 0: the resume says so, no alarm
    lines = metrics(run_dir)
    markers = [i for i, row in enumerate(lines) if row.get("event") == "resume"]
    assert len(markers) == 1 and lines[markers[0]]["env_steps"] == done
    after = [row for row in lines[markers[0] + 1 :] if "event" not in row]
    assert after[0]["env_steps"] >= done and after[0]["wall_time_s"] > lines[markers[0] - 1]["wall_time_s"]
    assert min(row["policy_version"] for row in after) >= version  # never a version-0 row after the restart
    total = after[-1]["env_steps"]
    assert done + 8000 <= total < done + 8000 + 10_000, "--total-steps counts the whole run"
    assert re.search(
        rf"stopped \(reached {done + 8000:,} env steps\).*: {total:,} env steps \({total - done:,} in this session\)",
        second,
    )
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert re.search(r"resumed from .*checkpoint-\d+\.pt at policy version \d+", trainer_log)
    assert "Redis lacks policy version" not in trainer_log  # nothing repeated every second at any version

    third = up(config, run_dir, "--total-steps", str(done + 8000))
    assert f"already has {total:,} env steps" in third and "nothing to do" in third

    fresh = up(config, run_dir, "--total-steps", "4000", "--fresh")
    assert "--fresh: removed" in fresh and "resuming" not in fresh
    rows = metrics(run_dir)
    assert all("event" not in row for row in rows) and rows[-1]["env_steps"] < total  # counted from 0
    assert "resumed from" not in (run_dir / "logs" / "trainer.log").read_text()
