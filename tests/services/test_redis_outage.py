"""The state store is supervised like a service: `up` restarts its embedded Valkey and the run finishes with its
counters intact; a Redis that stays away is reported in one line, by `up` and by every command."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.processes import child_pids, wait_for
from tests.support.running import cli, config_file, leftovers, report_rows, start_up
from tinker_atropos.processes import free_port
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration


def valkey_pid(parent: int) -> int:
    return next(pid for pid in child_pids(parent) if "valkey" in Path(f"/proc/{pid}/cmdline").read_text())


def test_up_restarts_its_killed_valkey_and_the_run_finishes_counting_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = start_up(config_file(tmp_path), run_dir, "--total-steps", "40000")
    try:
        wait_for(lambda: any(r["policy_version"] >= 2 for r in report_rows(run_dir)), 90, "two updates")
        os.kill(valkey_pid(up.pid), signal.SIGKILL)
        before = report_rows(run_dir)[-1]
        output = up.communicate(timeout=300)[0]
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, output[-3000:]
    assert "embedded Valkey exited with code" in output and "embedded Valkey restarted" in output
    assert "restored them from the last report" in output  # no persistence: Redis came back empty
    rows = report_rows(run_dir)
    steps, versions = [r["env_steps"] for r in rows], [r["policy_version"] for r in rows]
    assert steps == sorted(steps) and versions == sorted(versions), (steps, versions)
    assert rows[-1]["env_steps"] >= 40000 and rows[-1]["policy_version"] > before["policy_version"]
    assert "Traceback" not in output and "restart 1" not in output  # no service died of it
    assert leftovers(run_dir) == ""


def test_a_redis_that_stays_away_stops_up_in_one_line(tmp_path: Path) -> None:
    server = EmbeddedValkey(tmp_path / "valkey")
    run_dir = tmp_path / "run"
    config = config_file(tmp_path, redis={"unreachable_timeout_s": 3.0})
    up = start_up(config, run_dir, "--redis-url", server.url)
    try:
        wait_for(lambda: any(r["policy_version"] >= 1 for r in report_rows(run_dir)), 90, "the first update")
        server.stop()
        output = up.communicate(timeout=60)[0]
    finally:
        if up.poll() is None:
            up.kill()
        server.stop()
    assert up.returncode == 1, output[-3000:]
    lines = output.splitlines()
    assert sum("Redis unreachable (" in line for line in lines) == 1, output[-3000:]
    assert any("stopped (Redis unreachable for" in line for line in lines), output[-3000:]
    assert "did not stop in time" not in output  # every service drained on SIGTERM, Redis gone or not
    assert "Traceback" not in output
    assert leftovers(run_dir) == ""


def test_commands_report_an_unreachable_redis_in_one_line(tmp_path: Path) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    shown = cli("status", "--redis-url", nobody, timeout=30)
    lines = shown.stdout.strip().splitlines()
    assert shown.returncode == 1 and len(lines) == 1, shown.stdout
    assert lines[0].startswith(f"cannot reach Redis at {nobody}: ConnectionError") and "refused" in lines[0]

    config = config_file(tmp_path, redis={"unreachable_timeout_s": 2.0})
    env = cli("env", "--config", str(config), "--redis-url", nobody, timeout=60)
    assert env.returncode == 1
    lines = env.stderr.strip().splitlines()
    assert sum("unreachable" in line for line in lines) == 2, env.stderr  # waiting, then giving up
    assert lines[-1].startswith(f"error: Redis at {nobody} unreachable for 2 s (ConnectionError"), lines
    assert "Traceback" not in env.stderr
