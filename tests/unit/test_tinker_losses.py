"""Tinker's built-in losses (``training/losses.py``) against hand computations: values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tinker_atropos.training.losses import LossError, loss_fn

NAN = float("nan")


def logprobs(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_cross_entropy_and_importance_sampling_and_ppo_by_hand() -> None:
    lp = logprobs(-1.0, -2.0)
    assert loss_fn("cross_entropy")(lp, {"weights": torch.tensor([1.0, 0.5])}, {}).item() == pytest.approx(
        2.0
    )
    sampler = torch.tensor([-1.0, -1.0])
    advantages = torch.tensor([2.0, 1.0])
    value = loss_fn("importance_sampling")(lp, {"logprobs": sampler, "advantages": advantages}, {})
    assert value.item() == pytest.approx(-(2.0 + math.exp(-1.0)))
    # ppo: ratios 1 and e^-1 = 0.37; the second is clipped to 0.8 and min(0.37, 0.8) * 1 keeps the ratio
    value = loss_fn("ppo")(lp, {"logprobs": sampler, "advantages": advantages}, {})
    assert value.item() == pytest.approx(-(2.0 + math.exp(-1.0)))


def test_stable_reinforce_masks_far_ratios_and_untrained_positions_by_hand() -> None:
    """Positions: a prompt token (not sampled: NaN), then ratios 1, e^0.5 = 1.65, e^1 = 2.72 and e^-1 = 0.37 against
    the sampler's record. With the default bounds [0.5, 2] the last two are dropped."""
    lp = logprobs(-3.0, -1.0, -0.5, 0.0, -2.0)
    sampler = torch.tensor([NAN, -1.0, -1.0, -1.0, -1.0])
    advantages = torch.tensor([5.0, 1.0, 2.0, 3.0, 4.0])  # the prompt's advantage is ignored
    inputs = {"sampler_logprobs": sampler, "advantages": advantages, "logprobs": torch.full((5,), -9.0)}
    value = loss_fn("stable_reinforce")(lp, inputs, {})
    expected = -(1.0 * 1.0 + math.exp(0.5) * 2.0)
    assert value.item() == pytest.approx(expected)
    value.backward()
    # d/dlp of -(ratio * A) is -ratio * A where kept, 0 elsewhere; the client's ``logprobs`` play no part
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([0.0, -1.0, -2.0 * math.exp(0.5), 0.0, 0.0])

    wide = loss_fn("stable_reinforce")(lp, inputs, {"mask_low_threshold": 0.1, "mask_high_threshold": 3.0})
    assert wide.item() == pytest.approx(expected - math.e * 3.0 - math.exp(-1.0) * 4.0)


def test_stable_reinforce_equals_importance_sampling_when_no_ratio_is_masked() -> None:
    lp = logprobs(-1.0, -1.2, -0.9)
    sampler = torch.tensor([-1.1, -1.0, -1.0])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    stable = loss_fn("stable_reinforce")(lp, {"sampler_logprobs": sampler, "advantages": advantages}, {})
    plain = loss_fn("importance_sampling")(lp, {"logprobs": sampler, "advantages": advantages}, {})
    assert stable.item() == pytest.approx(plain.item())


def test_stable_reinforce_refuses_data_without_a_record_and_bounds_that_exclude_one() -> None:
    lp = logprobs(-1.0)
    with pytest.raises(LossError, match="provenance"):
        loss_fn("stable_reinforce")(lp, {"advantages": torch.ones(1), "logprobs": torch.zeros(1)}, {})
    inputs = {"sampler_logprobs": torch.zeros(1), "advantages": torch.ones(1)}
    with pytest.raises(LossError, match="must hold 1"):
        loss_fn("stable_reinforce")(lp, inputs, {"mask_low_threshold": 1.5})
    with pytest.raises(LossError, match="unknown loss 'dpo'"):
        loss_fn("dpo")


def test_cispo_weighs_each_log_probability_by_its_clipped_ratio_without_its_gradient() -> None:
    """Ratios 1, e^0.5 = 1.65 (clipped to 1.2) and e^-1 = 0.37 (clipped to 0.8): the value is -sum(clip(r) * lp * A)
    and each token's gradient -clip(r) * A, even where the ratio was clipped (PPO's would be 0 there)."""
    lp = logprobs(-1.0, -0.5, -2.0)
    inputs = {"logprobs": torch.tensor([-1.0, -1.0, -1.0]), "advantages": torch.tensor([1.0, 2.0, -3.0])}
    value = loss_fn("cispo")(lp, inputs, {})
    weights = [1.0, 1.2, 0.8]
    expected = -sum(w * p * a for w, p, a in zip(weights, [-1.0, -0.5, -2.0], [1.0, 2.0, -3.0], strict=True))
    assert value.item() == pytest.approx(expected)
    value.backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-1.0, -2.4, 2.4])
    wide = loss_fn("cispo")(lp, inputs, {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0})
    assert wide.item() == pytest.approx(-(-1.0 + math.exp(0.5) * -0.5 * 2.0 + math.exp(-1.0) * -2.0 * -3.0))


def test_dro_is_the_advantage_weighted_log_probability_minus_a_quadratic_penalty() -> None:
    lp = logprobs(-1.0, -0.5)
    inputs = {"logprobs": torch.tensor([-1.0, -1.5]), "advantages": torch.tensor([2.0, -1.0])}
    value = loss_fn("dro")(lp, inputs, {"beta": 0.4})
    assert value.item() == pytest.approx(-((-1.0 * 2.0) + (-0.5 * -1.0 - 0.5 * 0.4 * 1.0**2)))
    value.backward()
    # d/dlp: -(A - beta * (lp - q))
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-2.0, 1.0 + 0.4 * 1.0])
    default = loss_fn("dro")(lp, inputs, {})  # beta 0.05
    assert default.item() == pytest.approx(-((-1.0 * 2.0) + (-0.5 * -1.0 - 0.5 * 0.05)))
    with pytest.raises(LossError, match="beta"):
        loss_fn("dro")(lp, inputs, {"beta": -1.0})


def test_gspo_keeps_or_clips_whole_sequences_by_their_mean_log_ratio() -> None:
    """The sequence ratio is exp of the mean log-ratio over the masked targets; every target carries its value
    with the gradient of its own log-probability; clipped, the whole sequence gets no gradient."""
    lp = logprobs(-5.0, -1.0, -0.8, -1.2)
    sampler = torch.tensor([-1.0, -1.1, -1.0, -1.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])  # a prompt target outside the ratio
    advantages = torch.tensor([0.0, 1.0, 1.0, 1.0])
    inputs = {"logprobs": sampler, "advantages": advantages, "sequence_ratio_mask": mask}
    s = math.exp((0.1 + 0.2 - 0.2) / 3)  # within [0.8, 1.2]
    value = loss_fn("gspo")(lp, inputs, {})
    assert value.item() == pytest.approx(-3 * s)
    value.backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([0.0, -s, -s, -s])

    far = {
        **inputs,
        "logprobs": torch.tensor([-1.0, -2.0, -2.0, -2.0]),
    }  # s = e^1 > 1.2, advantages positive
    lp.grad = None
    clipped = loss_fn("gspo")(lp, far, {})
    s_far = math.exp((1.0 + 1.2 + 0.8) / 3)
    assert clipped.item() == pytest.approx(-3 * 1.2) and s_far > 1.2
    clipped.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0])

    without_mask = loss_fn("gspo")(lp, {"logprobs": sampler, "advantages": advantages}, {})  # every target
    every = math.exp((-4.0 + 0.1 + 0.2 - 0.2) / 4)  # 0.40, clipped to 0.8; min(s A, 0.8 A) = s A for A >= 0
    assert without_mask.item() == pytest.approx(-3 * every)
    with pytest.raises(LossError, match="marks no target"):
        loss_fn("gspo")(lp, {**inputs, "sequence_ratio_mask": torch.zeros(4)}, {})
