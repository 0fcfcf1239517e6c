"""The language-model RL benchmark runs every system with one set of settings, on a task it names, timed from the
same moment: the shipped Atropos config is checked against those settings, the Atropos clock starts when its
environment starts sampling (the trainer's registration), not at its first step's end, and each task keeps a
held-out set of sums that training never draws."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.llm_rl import _atropos_curve, _check_shipped, _registered_at, over_rounds, title
from examples.atropos_arithmetic_env import TASKS, held_out, problems

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_config_runs_the_benchmarks_settings_and_a_change_is_named() -> None:
    section = yaml.safe_load((REPO / "configs" / "atropos-smollm2-arithmetic.yaml").read_text())["trainer"]
    _check_shipped(section["atropos"])
    with pytest.raises(RuntimeError, match="adam_beta2.*0.999"):
        _check_shipped(section["atropos"] | {"adam_beta2": 0.999})


def test_the_atropos_clock_starts_at_registration_when_the_first_batch_is_sampled() -> None:
    log = "2026-12-07 10:00:00,500 trainer INFO x: learning M (LoRA rank 16) from the trajectory API at http://a\n"
    registered = _registered_at("2026-12-07 09:59:59,000 trainer INFO x: loading\n" + log)
    # up started 20 s before registration; the first step ended 30 s after it (its batch sampled meanwhile)
    rows = [
        {"policy_version": 0, "losses": {}, "wall_time_s": 25.0, "time": registered + 5.0, "episodes": 0},
        {
            "policy_version": 1,
            "losses": {"step_seconds": 4.0, "sequences_trained": 32},
            "wall_time_s": 50.0,
            "time": registered + 30.0,
            "episodes": 32,
            "episode_return_mean": 0.25,
            "env_steps": 200,
        },
    ]
    (point,) = _atropos_curve(rows, registered)["points"]
    assert point["seconds"] == pytest.approx(30.0)  # not 4 s: the first batch's sampling counts


def test_each_task_trains_on_its_pairs_and_evaluates_on_the_others() -> None:
    for name, task in TASKS.items():
        train, held = problems(0, 500, name), problems(1, 200, name, evaluation=True)
        assert not any(held_out(*pair) for pair in train) and all(held_out(*pair) for pair in held)
        assert all(task.a[0] <= a <= task.a[1] and task.b[0] <= b <= task.b[1] for a, b in train + held)
        assert problems(0, 50, name) == train[:50]  # the same draw for every system
    assert "two-digit plus one-digit addition" in title("two-digit-plus-one")


def test_rounds_are_summed_up_by_their_mean_and_the_final_rewards_range() -> None:
    rounds = over_rounds([{"final_reward": 0.6, "seconds": 60.0}, {"final_reward": 0.8, "seconds": 62.0}])
    assert rounds["final_reward"] == pytest.approx(0.7) and rounds["final_reward_range"] == [0.6, 0.8]
    assert rounds["rounds"] == 2 and rounds["seconds"] == pytest.approx(61.0)
