"""The mujoco backend against the gymnasium one: the same seeds and actions must give the same results.

Episodes are run long enough that instances terminate or hit the time limit and are reset, so the terminal
observations, the autoreset and the reset-noise RNG streams are compared too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tinker_atropos.environment.backends.base import BatchSetup, make_env_batch
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.environment.backends.mujoco_batch import MujocoBatch
from tinker_atropos.protocol.steps import StepBatch

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def assert_same_step(got: StepBatch, expected: StepBatch) -> None:
    assert got.observations.dtype == np.float32
    np.testing.assert_allclose(got.observations, expected.observations, **TOLERANCE)
    np.testing.assert_allclose(got.rewards, expected.rewards, **TOLERANCE)
    np.testing.assert_array_equal(got.terminated, expected.terminated)
    np.testing.assert_array_equal(got.truncated, expected.truncated)
    np.testing.assert_array_equal(got.final_indices, expected.final_indices)
    assert got.final_observations.shape == expected.final_observations.shape
    np.testing.assert_allclose(got.final_observations, expected.final_observations, **TOLERANCE)


def run_both(
    env_id: str, kwargs: dict[str, Any], num_instances: int, steps: int, num_threads: int = 2, seed: int = 3
) -> dict[str, int]:
    """Step both backends side by side, asserting equality at every step; count the episode ends."""
    reference = GymnasiumBatch(BatchSetup(env_id, kwargs, num_instances))
    fast = MujocoBatch(BatchSetup(env_id, kwargs, num_instances, num_threads=num_threads))
    try:
        assert fast.observation_space == reference.observation_space
        assert fast.action_space == reference.action_space
        np.testing.assert_allclose(fast.reset(seed), reference.reset(seed), **TOLERANCE)
        space = reference.action_space
        rng = np.random.default_rng(seed)
        ends = {"terminated": 0, "truncated": 0}
        for _ in range(steps):
            actions = rng.uniform(space.low, space.high, (num_instances, *space.shape)).astype(np.float32)
            expected = reference.step(actions)
            got = fast.step(actions)
            assert_same_step(got, expected)
            ends["terminated"] += int(expected.terminated.sum())
            ends["truncated"] += int(expected.truncated.sum())
        return ends
    finally:
        reference.close()
        fast.close()


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_humanoid_matches_gymnasium_through_terminations(num_threads: int) -> None:
    ends = run_both("Humanoid-v5", {}, num_instances=5, steps=80, num_threads=num_threads)
    assert ends["terminated"] >= 5  # random actions make a Humanoid fall within ~30 steps


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_episode_steps": 7, "terminate_when_unhealthy": False},
        {
            "exclude_current_positions_from_observation": False,
            "include_cinert_in_observation": False,
            "include_cfrc_ext_in_observation": False,
            "forward_reward_weight": 2.0,
            "healthy_z_range": (0.9, 2.0),
            "reset_noise_scale": 0.05,
        },
    ],
)
def test_humanoid_kwargs_match_gymnasium(kwargs: dict[str, Any]) -> None:
    ends = run_both("Humanoid-v5", kwargs, num_instances=3, steps=30)
    assert ends["terminated"] + ends["truncated"] > 0
    if kwargs.get("max_episode_steps") == 7:
        assert ends["terminated"] == 0 and ends["truncated"] == 3 * (30 // 7)


@pytest.mark.parametrize(
    ("env_id", "kwargs", "steps"),
    [
        ("HalfCheetah-v5", {}, 1001),  # the registered 1000-step time limit
        (
            "HalfCheetah-v5",
            {"max_episode_steps": 25, "exclude_current_positions_from_observation": False},
            60,
        ),
        ("Ant-v5", {"max_episode_steps": 25}, 60),
        (
            "Ant-v5",
            {"max_episode_steps": 25, "include_cfrc_ext_in_observation": False, "main_body": "torso"},
            30,
        ),
        ("Hopper-v5", {"max_episode_steps": 25}, 60),
        ("Walker2d-v5", {"max_episode_steps": 25}, 60),
    ],
)
def test_other_envs_match_gymnasium(env_id: str, kwargs: dict[str, Any], steps: int) -> None:
    num_instances = 2 if steps > 100 else 4
    ends = run_both(env_id, kwargs, num_instances=num_instances, steps=steps)
    assert ends["truncated"] > 0


def test_reset_without_seed_continues_each_instance_rng() -> None:
    reference = GymnasiumBatch(BatchSetup("Hopper-v5", {}, 3))
    fast = MujocoBatch(BatchSetup("Hopper-v5", {}, 3))
    for seed in (11, None, None):
        np.testing.assert_allclose(fast.reset(seed), reference.reset(seed), **TOLERANCE)


def test_unseeded_resets_differ_between_instances() -> None:
    observations = MujocoBatch(BatchSetup("HalfCheetah-v5", {}, 2)).reset(None)
    assert not np.array_equal(observations[0], observations[1])


def test_unsupported_env_id_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'CartPole-v1'.*Humanoid-v5.*'gymnasium'"):
        MujocoBatch(BatchSetup("CartPole-v1", {}, 2))


@pytest.mark.parametrize("kwargs", [{"render_mode": "rgb_array"}, {"width": 64}])
def test_unsupported_kwarg_is_named(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=repr(next(iter(kwargs)))):
        MujocoBatch(BatchSetup("Ant-v5", kwargs, 2))


@pytest.mark.parametrize("max_episode_steps", [0, 2.5])
def test_bad_time_limit_is_rejected(max_episode_steps: Any) -> None:
    with pytest.raises(ValueError, match="max_episode_steps"):
        MujocoBatch(BatchSetup("Hopper-v5", {"max_episode_steps": max_episode_steps}, 2))


def test_step_before_reset_is_refused() -> None:
    batch = MujocoBatch(BatchSetup("Hopper-v5", {}, 2))
    with pytest.raises(RuntimeError, match="before reset"):
        batch.step(np.zeros((2, 3), np.float32))


def test_make_env_batch_builds_the_mujoco_backend() -> None:
    batch = make_env_batch("mujoco", "Humanoid-v5", {}, 2)
    assert isinstance(batch, MujocoBatch)
    assert batch.reset(0).shape == (2, 348)
    with pytest.raises(ValueError, match="'mujoco'"):
        make_env_batch("nonsense", "Humanoid-v5", {}, 2)
