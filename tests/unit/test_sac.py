"""SAC on hand-checked cases: the replay buffer's transitions (truncation bootstraps from the final observation),
the soft Bellman target, the squashed policy the rollouts act with, and a checkpoint that continues exactly."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import AffineTransform, Normal, TanhTransform, TransformedDistribution

from tests.support.records import ACT, OBS, trajectory_chunk
from tinker_atropos.algorithms.base import LearnerSetup, algorithm
from tinker_atropos.algorithms.sac.learning import soft_bellman_target
from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.models.acting import InferencePolicy
from tinker_atropos.models.mlp import LOG_STD_MAX, LOG_STD_MIN
from tinker_atropos.protocol.trajectory import (
    TrajectorySpec,
    decode_trajectory,
    encode_trajectory,
)
from tinker_atropos.training.replay import ReplayBuffer


def sac_learner(**sac: object):
    config = parse_config({"env": {"id": "Pendulum-v1"}, "trainer": {"algorithm": "sac", "sac": sac}})
    space = gym.spaces.Box(-np.ones(ACT, np.float32) * 2, np.ones(ACT, np.float32) * 2)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
    setup = LearnerSetup(
        obs_space, space, config.trainer, config.trainer.hyperparameters, torch.device("cpu"), 3
    )
    return algorithm("sac").build(setup)


def test_a_truncated_step_bootstraps_from_its_final_observation_not_the_next_episode() -> None:
    rng = np.random.default_rng(0)
    truncated = np.zeros((4, 2), bool)
    truncated[1, 0] = truncated[3, 1] = True  # mid-chunk, and on the chunk's last step
    terminated = np.zeros((4, 2), bool)
    terminated[2, 1] = True
    trajectory = trajectory_chunk(rng, truncated=truncated, terminated=terminated)
    # the record keeps the final observations through the wire, in time-major order
    decoded = decode_trajectory(encode_trajectory(trajectory), TrajectorySpec((OBS,), (ACT,), None))
    np.testing.assert_array_equal(decoded.truncated_observations, trajectory.truncated_observations)

    buffer = ReplayBuffer(100, (OBS,), (ACT,))
    assert buffer.add(decoded) == 8
    rows = buffer.next_observations[:8].reshape(4, 2, OBS)
    obs = trajectory.observations
    np.testing.assert_array_equal(rows[1, 0], trajectory.truncated_observations[0])  # not obs[2, 0], a reset
    np.testing.assert_array_equal(rows[3, 1], trajectory.truncated_observations[1])  # not the bootstrap one
    np.testing.assert_array_equal(rows[0, 0], obs[1, 0])
    np.testing.assert_array_equal(rows[3, 0], trajectory.bootstrap_observations[0])
    np.testing.assert_array_equal(buffer.terminated[:8].reshape(4, 2), terminated)  # truncation is not an end


def test_the_soft_target_of_a_truncated_step_uses_the_final_observation() -> None:
    learner = sac_learner()
    rng = np.random.default_rng(1)
    truncated = np.zeros((1, 1), bool)
    truncated[0, 0] = True
    buffer = ReplayBuffer(10, (OBS,), (ACT,))
    trajectory = trajectory_chunk(rng, truncated=truncated)
    buffer.add(trajectory)
    batch = buffer.sample(1, np.random.default_rng(0), torch.device("cpu"))
    alpha, gamma = torch.tensor(0.3), 0.9
    torch.manual_seed(5)
    target = soft_bellman_target(
        learner.core.model,
        learner.critics.target,
        alpha,
        batch.rewards,
        batch.next_observations,
        batch.terminated,
        gamma,
    )
    # by hand: the same draw of a' at the final observation
    final = torch.as_tensor(trajectory.truncated_observations)
    torch.manual_seed(5)
    with torch.no_grad():
        next_action, log_prob = learner.core.model.squashed_sample(final)
        q = torch.min(*learner.critics.target(final, next_action))
    expected = float(trajectory.rewards[0, 0]) + gamma * (q - alpha * log_prob)
    torch.testing.assert_close(target, expected)
    # a terminated step's target is its reward alone
    ended = soft_bellman_target(
        learner.core.model,
        learner.critics.target,
        alpha,
        batch.rewards,
        batch.next_observations,
        torch.ones(1),
        gamma,
    )
    torch.testing.assert_close(ended, batch.rewards)


def test_the_rollout_acts_within_the_bounds_with_the_squashed_density() -> None:
    """The acting form's log-probabilities are the density of tanh(Gaussian) scaled to the bounds, computed here
    by torch's transformed distribution."""
    learner = sac_learner()
    model = learner.core.model
    with torch.no_grad():  # a policy far from its initialisation
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    obs = np.random.default_rng(2).normal(size=(64, OBS)).astype(np.float32)
    actions, log_probs, values = InferencePolicy.of_model(model, "cpu", np.random.default_rng(3)).act(obs)
    assert values is None and actions.shape == (64, ACT)
    assert np.all(np.abs(actions) <= 2.0)
    with torch.no_grad():
        mean, log_std = model.actor(torch.as_tensor(obs)).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        density = TransformedDistribution(
            Normal(mean, log_std.exp()), [TanhTransform(), AffineTransform(0.0, 2.0)], validate_args=False
        )
        expected = density.log_prob(torch.as_tensor(actions)).sum(-1)
    np.testing.assert_allclose(log_probs, expected.numpy(), rtol=1e-3, atol=2e-3)
    # evaluation acts with tanh of the mean, scaled to the bounds
    modes, mode_log_probs, _ = InferencePolicy.of_model(model, "cpu").act(obs, deterministic=True)
    np.testing.assert_allclose(modes, 2.0 * np.tanh(mean.numpy()), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        expected_modes = density.log_prob(torch.as_tensor(modes)).sum(-1)
    np.testing.assert_allclose(mode_log_probs, expected_modes.numpy(), rtol=1e-3, atol=2e-3)


def test_gradient_steps_follow_the_update_to_data_ratio_after_learning_starts() -> None:
    learner = sac_learner(learning_starts=24, utd_ratio=0.5, batch_size=8)
    rng = np.random.default_rng(4)
    # 16 transitions: still gathering
    first = learner.learn([trajectory_chunk(rng, truncated=np.zeros((4, 4), bool))])
    assert first["gradient_steps"] == 0 and first["replay_size"] == 16
    # 36 >= 24: 20 received, 10 steps owed
    second = learner.learn([trajectory_chunk(rng, truncated=np.zeros((5, 4), bool))])
    assert second["gradient_steps"] == 10 and second["utd_ratio"] == 0.5
    assert all(np.isfinite(v) for v in second.values())


def test_a_checkpointed_learner_continues_exactly() -> None:
    """state_dict and the replay buffer's transitions restore a learner whose next update is bit-identical."""
    rng = np.random.default_rng(5)
    learner = sac_learner(learning_starts=8, batch_size=8)
    learner.learn([trajectory_chunk(rng, truncated=rng.random((6, 2)) < 0.2)])
    saved, replay = copy.deepcopy(learner.state_dict()), learner.replay.since(0)
    more = trajectory_chunk(rng, truncated=rng.random((6, 2)) < 0.2)
    expected = learner.learn([more])
    resumed = sac_learner(learning_starts=8, batch_size=8)
    resumed.load_state_dict(saved)  # also the process's RNGs, as a restarted trainer's
    resumed.replay.refill(replay, added=12)
    assert resumed.learn([more]) == expected
    for a, b in zip(learner.core.model.parameters(), resumed.core.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_ring_keeps_the_latest_transitions_and_restores_them_oldest_first() -> None:
    rng = np.random.default_rng(6)
    buffer = ReplayBuffer(10, (OBS,), (ACT,))
    # 18 transitions into 10 places
    chunks = [trajectory_chunk(rng, truncated=np.zeros((3, 2), bool)) for _ in range(3)]
    for c in chunks:
        buffer.add(c)
    latest = np.concatenate([c.rewards.reshape(-1) for c in chunks])[-10:]
    np.testing.assert_array_equal(buffer.since(0)["rewards"], latest)
    assert buffer.added == 18
    np.testing.assert_array_equal(buffer.since(15)["rewards"], latest[-3:])  # numbered as they came in
    smaller = ReplayBuffer(4, (OBS,), (ACT,))
    smaller.refill(buffer.since(0), buffer.added)
    np.testing.assert_array_equal(smaller.since(0)["rewards"], latest[-4:])
    assert smaller.added == 18 and len(smaller.since(16)["rewards"]) == 2


def test_sac_refuses_a_discrete_action_space_and_other_algorithms_fields() -> None:
    config = parse_config({"env": {"id": "CartPole-v1"}, "trainer": {"algorithm": "sac"}})
    setup = LearnerSetup(
        gym.spaces.Box(-1, 1, (4,)),
        gym.spaces.Discrete(2),
        config.trainer,
        config.trainer.hyperparameters,
        torch.device("cpu"),
        0,
    )
    with pytest.raises(ValueError, match="SAC acts in bounded Box action spaces"):
        algorithm("sac").build(setup)
    with pytest.raises(ConfigError, match=r"trainer\.sac\.gae_lambda"):
        parse_config({"trainer": {"algorithm": "sac", "sac": {"gae_lambda": 0.9}}})
    with pytest.raises(ConfigError, match=r"trainer\.ppo"):
        parse_config({"trainer": {"algorithm": "sac", "ppo": {}}})
