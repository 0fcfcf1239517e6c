"""`up` supervises its services: a killed one is restarted and the run keeps learning; Ctrl-C stops all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.integration


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent``, read from /proc: the services and the embedded Valkey."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def start_up(run_dir: Path, *options: str) -> subprocess.Popen:
    """``tinker-atropos up`` on the Pendulum config, its output piped for the assertions."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinker_atropos",
            "up",
            str(REPO / "configs" / "pendulum.yaml"),
            "--run-dir",
            str(run_dir),
            *options,
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def service_pid(run_dir: Path, kind: str) -> int | None:
    found = subprocess.run(
        ["pgrep", "-f", f"tinker_atropos {kind} --config {run_dir}"], capture_output=True, text=True
    )
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


@pytest.mark.parametrize("kind", ["env", "rollout", "trainer"])
def test_a_killed_service_is_restarted_and_the_run_goes_on(tmp_path: Path, kind: str) -> None:
    run_dir = tmp_path / "run"
    up = start_up(run_dir)
    try:
        wait_for(lambda: any(r["policy_version"] >= 2 for r in metrics(run_dir)), 90, "two updates")
        victim = service_pid(run_dir, kind)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = metrics(run_dir)[-1]
        wait_for(lambda: (service_pid(run_dir, kind) or victim) != victim, 30, f"{kind} to be restarted")
        wait_for(
            lambda: (
                metrics(run_dir)[-1]["env_steps"] > killed_at["env_steps"] + 10_000
                and metrics(run_dir)[-1]["policy_version"] > killed_at["policy_version"] + 2
            ),
            90,
            "env steps and policy version to keep rising after the restart",
        )
        children = child_pids(up.pid)
        assert len(children) == 4  # valkey, env, rollout, trainer
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    assert f"{kind}" in output and "restart 1" in output
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left behind: {alive}"
