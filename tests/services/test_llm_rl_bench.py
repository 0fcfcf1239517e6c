"""The language-model RL benchmark's peer and Tinker paths (``bench/llm_rl.py``, ``make bench-llm-rl``), two steps
each, as the benchmark runs them (a process of its own): TRL's GRPOTrainer, and the Tinker Cookbook's RL loop
through our Tinker API serving SmolLM2. Each writes its reward curve, its token counts and each step's time split.
Whether they learn, and how fast, is the benchmark's to measure; the Atropos path's short run is
tests/services/test_atropos_smollm2.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.llm_rl import COMPLETION_TOKENS, GROUP_SIZE, GROUPS, summary
from tests.support.running import REPO

# minutes of TRL and SmolLM2 that test the benchmark, not the product: make bench-llm-rl runs them first
pytestmark = [pytest.mark.integration, pytest.mark.bench_harness]

ANSWERS = GROUPS * GROUP_SIZE


@pytest.mark.parametrize("system", ["trl", "cookbook"])
def test_two_steps_of_each_path_write_the_reward_curve_and_the_step_split(
    system: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.llm_rl", system, "900", str(tmp_path), "single-digit", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    points = result["points"]
    assert len(points) == 2, points
    assert 0 < points[0]["seconds"] < points[1]["seconds"]
    # the mean of every answer so far (64 at most): a multiple of 1/32 after the first step's 32 answers
    assert all(0.0 <= p["reward"] <= 1.0 for p in points)
    assert (points[0]["reward"] * ANSWERS) == pytest.approx(round(points[0]["reward"] * ANSWERS), abs=1e-6)
    # each answer at least one token and at most COMPLETION_TOKENS
    assert ANSWERS <= points[0]["sampled_tokens"] <= ANSWERS * COMPLETION_TOKENS
    assert points[1]["sampled_tokens"] > points[0]["sampled_tokens"]
    figures = summary(result)
    assert figures["generation_s"] > 0 and figures["training_s"] > 0, result["steps"]
    if system == "trl":
        assert result["trl"] == "1.16.0" and result["config"]["num_generations"] == GROUP_SIZE
        # the settings every system runs: float32, no gradient checkpointing, no clipping, Adam's betas 0.9 and
        # 0.95 (GRPOConfig's defaults differ in each)
        config = result["config"]
        assert not config["gradient_checkpointing"] and not config["bf16"] and not config["fp16"]
        assert config["max_grad_norm"] == 0.0 and (config["adam_beta1"], config["adam_beta2"]) == (0.9, 0.95)
        assert "down_proj" in result["lora_targets"] and result["settings"]["precision"] == "float32"
    else:  # the cookbook saves the adapter and samples with it after each step: our weight sync
        assert figures["weight_sync_s"] > 0, result["steps"]
