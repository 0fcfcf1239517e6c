"""The shipped language-model RL config (configs/atropos-smollm2-arithmetic.yaml) end to end with ``up`` alone,
a few steps: the atroposlib environment samples SmolLM2's answers from the trainer's endpoint, the trainer takes
LoRA steps on them, and the reward metric (the mean of the latest 64 answers) is written. Whether it learns is
measured by ``make bench-llm-rl`` over 15 minutes, not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.atropos_arithmetic_env import GROUP_SIZE, problems, reward
from tests.support.processes import wait_for
from tests.support.running import atropos_up, leftovers, report_rows
from tinker_atropos.models import smollm2

pytestmark = pytest.mark.integration


def test_the_task_scores_the_last_integer_of_an_answer() -> None:
    assert problems(seed=0, count=3) == problems(seed=0, count=3) != problems(seed=1, count=3)
    assert all(0 <= a <= 9 and 0 <= b <= 9 for a, b in problems(seed=0, count=100))
    assert reward("The answer is 12.", 7, 5) == reward("7 + 5 = 12", 7, 5) == 1.0
    assert reward("7 + 5", 7, 5) == reward("twelve", 7, 5) == reward("12 or 13", 7, 5) == 0.0


def test_the_shipped_config_trains_smollm2_with_up_alone_and_writes_the_reward(tmp_path: Path) -> None:
    with atropos_up(
        tmp_path, "atropos-smollm2-arithmetic.yaml", max_seconds=400, report_interval_s=2.0
    ) as run:
        wait_for(
            lambda: any(r["policy_version"] >= 2 for r in report_rows(run.run_dir)),
            300,
            "two LoRA steps of the trainer",
            interval_s=1.0,
        )
    config, run_dir, output = run.config, run.run_dir, run.output()
    assert run.process.returncode == 0, output[-4000:]
    rows = [r for r in report_rows(run_dir) if r["episode_return_mean"] is not None]
    assert rows, output[-3000:]
    assert all(0.0 <= r["episode_return_mean"] <= 1.0 for r in rows)
    # each step's weight sync (the endpoint sampling with the new adapter) is timed and reported
    assert any(r["losses"].get("weight_sync_seconds", 0.0) > 0.0 for r in rows), rows[-1]
    # every answer of each batch counts, groups whose answers all scored alike too
    assert rows[-1]["episodes"] >= 2 * config["trainer"]["atropos"]["batch_size"]
    assert rows[-1]["episodes"] % GROUP_SIZE == 0
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert f"learning {smollm2.NAME} (LoRA rank 16) from the trajectory API" in trainer, trainer[-2000:]
    env_log = (run_dir / "logs" / "atropos-env-0.log").read_text()
    assert "Traceback" not in env_log and "Traceback" not in trainer, env_log[-3000:]
    assert "(last 64 episodes)" in output, output[-2000:]
    assert leftovers(run_dir) == ""
