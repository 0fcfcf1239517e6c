"""PPO maths on hand-checked cases: GAE with terminations and truncations, and the clipped loss."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from tests.support.records import trajectory_chunk
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.algorithms.ppo.config import PPOConfig
from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.algorithms.ppo.learning import Batch, compute_gae, ppo_loss
from tinker_atropos.config import TrainerSection
from tinker_atropos.models.acting import InferencePolicy
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.protocol.trajectory import contiguous_runs

GAMMA, LAM = 0.9, 0.8


def test_gae_matches_hand_computation_with_termination_and_truncation() -> None:
    # one instance, three steps: step 0 continues, step 1 is truncated (time limit), step 2 continues.
    rewards = np.array([[1.0], [2.0], [3.0]], np.float32)
    values = np.array([[0.5], [1.0], [1.5]], np.float32)
    terminated = np.zeros((3, 1), bool)
    truncated = np.array([[False], [True], [False]])
    truncation_values = np.array([[0.0], [4.0], [0.0]], np.float32)
    bootstrap = np.array([2.0], np.float32)

    adv, ret = compute_gae(rewards, values, terminated, truncated, truncation_values, bootstrap, GAMMA, LAM)

    d2 = 3.0 + GAMMA * 2.0 - 1.5  # bootstraps from the value after the chunk
    a2 = d2
    d1 = 2.0 + GAMMA * 4.0 - 1.0  # truncated: completed by V(final obs), next row is a new episode
    a1 = d1
    d0 = 1.0 + GAMMA * 1.0 - 0.5
    a0 = d0 + GAMMA * LAM * a1
    np.testing.assert_allclose(adv[:, 0], [a0, a1, a2], rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0], [a0 + 0.5, a1 + 1.0, a2 + 1.5], rtol=1e-6)


def test_gae_does_not_bootstrap_after_termination() -> None:
    rewards = np.array([[1.0, 1.0]], np.float32)
    values = np.array([[0.0, 0.0]], np.float32)
    terminated = np.array([[True, False]])
    truncated = np.zeros((1, 2), bool)
    adv, _ = compute_gae(
        rewards,
        values,
        terminated,
        truncated,
        np.zeros((1, 2), np.float32),
        np.array([10.0, 10.0], np.float32),
        GAMMA,
        LAM,
    )
    np.testing.assert_allclose(adv[0], [1.0, 1.0 + GAMMA * 10.0])


def _model(discrete: bool) -> ActorCritic:
    torch.manual_seed(0)
    action = {"kind": "discrete", "n": 3, "start": 0} if discrete else {"kind": "box", "shape": [2]}
    spec = {
        "obs_shape": [4],
        "action": action,
        "hidden_sizes": [8],
        "activation": "tanh",
        "init_log_std": 0.0,
        "normalize_observations": False,
        "normalize_returns": False,
    }
    return ActorCritic(spec)


@pytest.mark.parametrize("discrete", [False, True])
def test_ppo_loss_on_a_fixed_batch_matches_the_clipped_objective(discrete: bool) -> None:
    model = _model(discrete)
    g = torch.Generator().manual_seed(1)
    obs = torch.randn(6, 4, generator=g)
    actions = torch.randint(0, 3, (6,), generator=g) if discrete else torch.randn(6, 2, generator=g)
    with torch.no_grad():
        logp_now, _, _ = model.evaluate(obs, actions)
    # behaviour log-probs chosen so that some ratios fall outside [1 - clip, 1 + clip]
    shift = torch.tensor([0.0, 0.5, -0.5, 0.1, -0.1, 1.0])
    batch = Batch(
        obs,
        actions,
        logp_now - shift,
        torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, 1.5]),
        torch.arange(6, dtype=torch.float32),
    )
    hp = PPOConfig(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, normalize_advantages=False)

    loss, stats = ppo_loss(model, batch, hp)

    ratio = shift.exp()
    adv = batch.advantages
    expected_pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    with torch.no_grad():
        _, entropy, value = model.evaluate(obs, actions)
    expected_v = 0.5 * (value - batch.returns).square().mean()
    expected = expected_pg - 0.01 * entropy.mean() + 0.5 * expected_v
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert stats["policy_loss"] == pytest.approx(expected_pg.item(), rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(3 / 6)  # ratios e^0.5, e^-0.5 and e^1 are clipped


def test_ppo_loss_gradient_is_zero_for_clipped_samples() -> None:
    model = _model(discrete=False)
    obs, actions = torch.randn(1, 4), torch.randn(1, 2)
    with torch.no_grad():
        logp, _, _ = model.evaluate(obs, actions)
    # ratio = e^1 > 1 + clip with a positive advantage: the clipped branch is taken, no policy gradient
    batch = Batch(obs, actions, logp - 1.0, torch.tensor([1.0]), torch.zeros(1))
    hp = PPOConfig(ent_coef=0.0, vf_coef=0.0, normalize_advantages=False)
    loss, _ = ppo_loss(model, batch, hp)
    loss.backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.actor.parameters())


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("discrete", [False, True])
def test_inference_policy_equals_the_module(discrete: bool, library: str) -> None:
    """The rollout's fused network acts as the trainer's module: same values, same log-probs, same draws,
    whether it computes with numpy (CPU) or torch (other devices)."""
    torch.manual_seed(0)
    # a Discrete space that starts at 5: the env's actions are 5, 6, 7
    action = {"kind": "discrete", "n": 3, "start": 5} if discrete else {"kind": "box", "shape": [2]}
    spec = {
        "obs_shape": [4],
        "action": action,
        "hidden_sizes": [8, 6],
        "activation": "tanh",
        "init_log_std": -0.5,
        "normalize_observations": True,
        "normalize_returns": True,
    }
    model = ActorCritic(spec)
    model.obs_rms.update(torch.randn(64, 4) * 5 + 2)  # non-trivial normalisers, as after training
    model.return_rms.update(torch.randn(64) * 30 - 10)
    frozen = InferencePolicy.of_model(model, "cpu", np.random.default_rng(1), library)
    obs = torch.randn(16, 4) * 4

    with torch.no_grad():
        norm_obs = model.normalize_obs(obs)
        expected_values = model.denormalize_value(model.normalized_value(norm_obs))
        dist = model.distribution(norm_obs)
    torch.manual_seed(1)
    actions, log_probs, values = (torch.as_tensor(a) for a in frozen.act(obs.numpy()))
    torch.testing.assert_close(values, expected_values)
    torch.testing.assert_close(torch.as_tensor(frozen.value(obs.numpy())), expected_values)
    torch.testing.assert_close(log_probs, model.log_prob(dist, actions))
    if discrete:
        assert actions.dtype == torch.int64 and actions.min() >= 5 and actions.max() <= 7
        torch.testing.assert_close(log_probs, dist.log_prob(actions - 5))
        # the draws follow the policy's probabilities: 30,000 draws for one observation
        many, _, _ = frozen.act(obs[:1].repeat(30_000, 1).numpy())
        frequencies = np.bincount(many - 5, minlength=3) / len(many)
        np.testing.assert_allclose(frequencies, dist.probs[0].numpy(), atol=0.015)
    else:
        if library == "numpy":
            eps = torch.as_tensor(np.random.default_rng(1).standard_normal((16, 2), dtype=np.float32))
        else:
            torch.manual_seed(1)
            eps = torch.randn(16, 2)
        torch.testing.assert_close(actions, dist.mean + dist.stddev * eps)
    # evaluation acts with the mode, and reports the mode's log-probability
    modes, mode_log_probs, _ = (torch.as_tensor(a) for a in frozen.act(obs.numpy(), deterministic=True))
    expected_modes = dist.probs.argmax(dim=1) + 5 if discrete else dist.mean
    torch.testing.assert_close(modes, expected_modes)
    torch.testing.assert_close(mode_log_probs, model.log_prob(dist, modes))


def test_gae_runs_across_chunks_that_continue_one_another() -> None:
    """A session's next chunk starts at the previous one's bootstrap observations: GAE spans both, as over one
    rollout, even when another session's chunk arrived in between."""
    rng = np.random.default_rng(0)
    first = trajectory_chunk(rng, terminated=0.2, truncated=0.1)
    other = trajectory_chunk(rng, terminated=0.2, truncated=0.1)
    second = trajectory_chunk(rng, terminated=0.2, truncated=0.1, first_obs=first.bootstrap_observations)
    assert contiguous_runs([first, other, second]) == [[first, second], [other]]

    trainer = TrainerSection(ppo={"gamma": GAMMA, "gae_lambda": LAM, "normalize_advantages": False})
    spaces = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))
    setup = LearnerSetup(*spaces, trainer, trainer.hyperparameters, torch.device("cpu"), seed=0)
    batch = PPOLearner(setup).batch([first, other, second])

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(first, name), getattr(second, name)])

    advantages, returns = compute_gae(
        joined("rewards"),
        joined("values"),
        joined("terminated"),
        joined("truncated"),
        joined("truncation_values"),
        second.bootstrap_values,
        GAMMA,
        LAM,
    )
    alone, _ = compute_gae(
        other.rewards,
        other.values,
        other.terminated,
        other.truncated,
        other.truncation_values,
        other.bootstrap_values,
        GAMMA,
        LAM,
    )
    np.testing.assert_allclose(batch.advantages.numpy(), np.concatenate([advantages.ravel(), alone.ravel()]))
    np.testing.assert_allclose(batch.returns.numpy()[:20], returns.ravel())
    np.testing.assert_array_equal(batch.observations.numpy()[:20], joined("observations").reshape(20, 3))
    # without the link, the first chunk's last advantages would bootstrap from its own values instead
    cut, _ = compute_gae(
        first.rewards,
        first.values,
        first.terminated,
        first.truncated,
        first.truncation_values,
        first.bootstrap_values,
        GAMMA,
        LAM,
    )
    assert not np.allclose(cut, advantages[:5])


def _learner(**ppo: object) -> PPOLearner:
    trainer = TrainerSection(ppo=ppo)
    spaces = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))
    return PPOLearner(LearnerSetup(*spaces, trainer, trainer.hyperparameters, torch.device("cpu"), seed=0))


def test_the_learning_rate_anneals_linearly_to_zero_over_the_env_steps_learned_and_resumes_there() -> None:
    rng = np.random.default_rng(0)
    learner = _learner(learning_rate=1e-3, anneal_lr=True, anneal_env_steps=40, update_epochs=1)
    rates = [learner.learn([trajectory_chunk(rng)])["learning_rate"] for _ in range(3)]  # 10 env steps each
    assert rates == pytest.approx([1e-3, 0.75e-3, 0.5e-3])
    resumed = _learner(learning_rate=1e-3, anneal_lr=True, anneal_env_steps=40, update_epochs=1)
    resumed.load_state_dict(learner.state_dict())
    assert [resumed.learn([trajectory_chunk(rng)])["learning_rate"] for _ in range(2)] == pytest.approx(
        [0.25e-3, 0.0]
    )
    weights = [p.clone() for p in resumed.core.model.parameters()]
    resumed.learn([trajectory_chunk(rng)])  # past the span: a step size of 0 leaves the policy as it is
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed.core.model.parameters(), strict=True))
    # constant by default
    assert _learner(learning_rate=1e-3).learn([trajectory_chunk(rng)])["learning_rate"] == 1e-3


def test_target_kl_stops_the_update_at_the_first_minibatch_past_it_without_its_step() -> None:
    rng = np.random.default_rng(0)
    chunks = [trajectory_chunk(rng, 16) for _ in range(4)]  # 128 samples, 8 minibatches of 16
    free = _learner(learning_rate=3e-2, update_epochs=4, num_minibatches=8).learn(chunks)
    assert free["epochs"] == 4
    braked = _learner(learning_rate=3e-2, update_epochs=4, num_minibatches=8, target_kl=0.01)
    before = {name: p.clone() for name, p in braked.core.model.named_parameters()}
    figures = braked.learn(chunks)
    assert 0 < figures["epochs"] < 4 and figures["update_kl"] <= 0.01  # the mean over the steps taken
    model = braked.core.model
    assert all(p.grad is None for p in model.parameters())  # the refused step's gradients discarded
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
