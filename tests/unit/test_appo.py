"""APPO's V-trace on hand-checked cases (off-policy weights, truncation, termination), its known identity with
GAE on-policy, and the learner's targets from the current critic and policy."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from tests.support.records import trajectory_chunk
from tinker_atropos.algorithms.appo.learner import APPOLearner
from tinker_atropos.algorithms.appo.learning import compute_vtrace
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.algorithms.ppo.learning import compute_gae
from tinker_atropos.config import ConfigError, TrainerSection, parse_config

GAMMA = 0.9


def _column(*values: float) -> np.ndarray:
    return np.array(values, np.float32)[:, None]


def test_vtrace_matches_a_hand_computation_with_truncated_importance_weights() -> None:
    # one instance, three steps, no episode end; the current policy is half as likely, then twice, then as likely
    behaviour = np.log(_column(0.5, 0.5, 0.5))
    target = np.log(_column(0.25, 1.0, 0.5))  # pi/mu = 0.5, 2 (truncated to 1), 1
    never = np.zeros((3, 1), bool)
    targets, advantages = compute_vtrace(
        behaviour,
        target,
        _column(1.0, 2.0, 3.0),
        _column(0.5, 1.0, 1.5),
        never,
        never,
        _column(0, 0, 0),
        np.array([2.0], np.float32),
        GAMMA,
    )
    # by hand: delta_2 = 3 + 0.9*2 - 1.5 = 3.3; delta_1 = 2 + 0.9*1.5 - 1 = 2.35; delta_0 = 0.5*(1 + 0.9*1 - 0.5)
    # = 0.7; v_2 = 1.5 + 3.3 = 4.8; v_1 = 1 + 2.35 + 0.9*1*3.3 = 6.32; v_0 = 0.5 + 0.7 + 0.9*0.5*5.32 = 3.594
    np.testing.assert_allclose(targets[:, 0], [3.594, 6.32, 4.8], rtol=1e-5)
    # advantage_t = rho_t (r_t + 0.9 v_t+1 - V_t): 0.5*(1 + 0.9*6.32 - 0.5), 2 + 0.9*4.8 - 1, 3 + 0.9*2 - 1.5
    np.testing.assert_allclose(advantages[:, 0], [3.094, 5.32, 3.3], rtol=1e-5)


def test_vtrace_bootstraps_a_truncated_step_from_its_final_observation_and_stops_at_a_termination() -> None:
    on_policy = np.zeros((3, 1), np.float32)
    terminated = np.array([[False], [False], [True]])
    truncated = np.array([[True], [False], [False]])
    targets, advantages = compute_vtrace(
        on_policy,
        on_policy,
        _column(0.0, 1.0, 5.0),
        _column(1.0, 100.0, 2.0),
        terminated,
        truncated,
        _column(10.0, 0.0, 0.0),
        np.array([50.0], np.float32),
        GAMMA,
    )
    # step 0: time limit, its future is V(final obs) = 10, never the next episode's V = 100; step 2: no future
    np.testing.assert_allclose(targets[:, 0], [9.0, 1.0 + GAMMA * 5.0, 5.0], rtol=1e-6)
    np.testing.assert_allclose(advantages[:, 0], [8.0, 1.0 + GAMMA * 5.0 - 100.0, 3.0], rtol=1e-6)


def test_on_policy_vtrace_is_gae_with_lambda_one_or_its_own_lambda() -> None:
    """With pi = mu and untruncated weights (c_t = lambda), V-trace's targets are GAE's lambda-returns."""
    rng = np.random.default_rng(0)
    t, n = 7, 3
    log_probs = rng.normal(size=(t, n)).astype(np.float32)
    rewards, values = rng.normal(size=(t, n)).astype(np.float32), rng.normal(size=(t, n)).astype(np.float32)
    terminated, truncated = rng.random((t, n)) < 0.15, rng.random((t, n)) < 0.1
    truncation_values, bootstrap = (
        rng.normal(size=(t, n)).astype(np.float32),
        rng.normal(size=n).astype(np.float32),
    )
    for lam in (1.0, 0.8):
        targets, _ = compute_vtrace(
            log_probs,
            log_probs,
            rewards,
            values,
            terminated,
            truncated,
            truncation_values,
            bootstrap,
            GAMMA,
            trace_lambda=lam,
        )
        _, returns = compute_gae(
            rewards, values, terminated, truncated, truncation_values, bootstrap, GAMMA, lam
        )
        np.testing.assert_allclose(targets, returns, rtol=1e-5, atol=1e-5)


def test_the_learner_takes_values_and_log_probs_from_the_current_networks_not_the_chunk() -> None:
    rng = np.random.default_rng(1)
    chunk = trajectory_chunk(rng, terminated=0.2, truncated=0.1)
    trainer = TrainerSection(algorithm="appo", appo={"gamma": GAMMA, "normalize_advantages": False})
    spaces = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))
    learner = APPOLearner(
        LearnerSetup(*spaces, trainer, trainer.hyperparameters, torch.device("cpu"), seed=0)
    )
    batch = learner.batch([chunk])

    log_probs, values, bootstrap = learner._current_policy(
        chunk.observations, chunk.actions, chunk.bootstrap_observations
    )
    assert not np.allclose(values, chunk.values)  # the chunk's are random: the critic's differ
    targets, advantages = compute_vtrace(
        chunk.log_probs,
        log_probs,
        chunk.rewards,
        values,
        chunk.terminated,
        chunk.truncated,
        chunk.truncation_values,
        bootstrap,
        GAMMA,
    )
    np.testing.assert_allclose(batch.returns.numpy(), targets.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.advantages.numpy(), advantages.reshape(-1), rtol=1e-5, atol=1e-5)
    assert np.isfinite(list(learner.learn([chunk]).values())).all()


def test_appo_has_its_own_section_and_refuses_ppos() -> None:
    config = parse_config({"trainer": {"algorithm": "appo", "appo": {"vtrace_c_bar": 0.9}}})
    assert config.trainer.hyperparameters.vtrace_c_bar == 0.9
    with pytest.raises(ConfigError, match="trainer.ppo"):
        parse_config({"trainer": {"algorithm": "appo", "ppo": {"gamma": 0.9}}})
    with pytest.raises(ConfigError, match="trainer.appo.gae_lambda"):
        parse_config({"trainer": {"algorithm": "appo", "appo": {"gae_lambda": 0.9}}})
