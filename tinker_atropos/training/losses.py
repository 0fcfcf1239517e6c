"""Tinker's built-in losses, as its documentation defines them: sums over every target of every datum (not
means), computed from the log-probabilities the model gives its targets.

- ``cross_entropy``: ``-(weights * target_logprobs).sum()`` (weights default to 1)
- ``importance_sampling``: ``-(exp(target_logprobs - logprobs) * advantages).sum()``, ``logprobs`` being the
  sampling policy's
- ``ppo``: the clipped surrogate ``-min(ratio * A, clip(ratio, low, high) * A).sum()`` with the ratio bounds
  ``clip_low_threshold`` / ``clip_high_threshold`` (per target in ``loss_fn_inputs`` or one value in
  ``loss_fn_config``), 0.8 and 1.2 by default (epsilon 0.2)
- ``cispo``: the clipped ratio as a coefficient without gradient, ``-(sg(clip(ratio, low, high)) * target_logprobs
  * advantages).sum()``: every token keeps the gradient of its log-probability, its weight bounded (the same
  bounds as ``ppo``, 0.8 and 1.2 by default: Tinker does not publish its defaults, these are ours)
- ``dro``: ``-(target_logprobs * advantages - beta / 2 * (target_logprobs - logprobs) ** 2).sum()``, ``beta`` from
  ``loss_fn_config`` (0.05 by default, ours: the value of Tinker's example); the soft advantages are the client's
- ``gspo``, Tinker's token-level variant (GSPO-token): the sequence ratio ``s = exp(mean(target_logprobs -
  logprobs))`` over the targets ``sequence_ratio_mask`` marks (every target without one), each target's ratio
  ``sg(s) * p / sg(p)`` (its value ``s``, the gradient of its own log-probability), then ``ppo``'s clipped
  surrogate with the same bounds: whole sequences are kept or clipped. A datum is one sequence
- ``stable_reinforce``: REINFORCE whose importance ratio is taken against the log-probabilities the *sampler
  recorded* for the tokens it sampled (``record_stability_info=True``; the datum's provenance spans name the
  sequence behind each target, ``tinker_api/store/sequences.py`` looks them up) and whose tokens are dropped where
  trainer and sampler disagree too much: ``-(keep * ratio * advantages).sum()`` with ``ratio = exp(target_logprobs
  - sampler_logprobs)`` and ``keep`` the sampled targets whose ratio lies in [``mask_low_threshold``,
  ``mask_high_threshold``] (``loss_fn_config``; 0.5 and 2.0 by default). Tinker names the loss and its inputs but
  does not publish its objective: this one is ours, the token-level masked importance sampling of IcePop
  (inclusionAI's Ring-1T, 2025) on the sampler's own record, so that neither a client's rounding of the
  log-probs nor tokens the trainer finds far likelier or unlikelier than the sampler did (stale weights in async
  RL, other numerics) move the policy. Where every ratio lies within the bounds it equals ``importance_sampling``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinker_atropos.training.data import ClientError

Inputs = dict[str, torch.Tensor]
Config = dict[str, float | str]
CLIP_LOW, CLIP_HIGH = (
    0.8,
    1.2,
)  # ppo's (and cispo's, gspo's) ratio bounds when neither inputs nor config give them


class LossError(ClientError):
    """An unknown loss, or inputs it cannot be computed from: the client's error."""


def config_number(config: Config, name: str, default: float) -> float:
    """``loss_fn_config[name]`` (``default`` when absent); LossError unless it is a number."""
    value = config.get(name, default)
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, float):
        raise LossError(f"loss_fn_config[{name!r}] must be a number, got {value!r}")
    return value


def _bound(inputs: Inputs, config: Config, name: str, default: float) -> torch.Tensor | float:
    """A per-target bound from ``loss_fn_inputs``, else one from ``loss_fn_config``."""
    return inputs[name] if name in inputs else config_number(config, name, default)


def cross_entropy(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(logprobs if weights is None else logprobs * weights).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, _clip(ratio, inputs, config) * advantages).sum()


def _clip(ratio: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    """``ratio`` within [``clip_low_threshold``, ``clip_high_threshold``] (0.8 and 1.2 by default)."""
    low = _bound(inputs, config, "clip_low_threshold", CLIP_LOW)
    high = _bound(inputs, config, "clip_high_threshold", CLIP_HIGH)
    return torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high))


def cispo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(_clip(ratio, inputs, config).detach() * logprobs * inputs["advantages"]).sum()


def dro(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = config_number(config, "beta", 0.05)
    if beta < 0:
        raise LossError(f"dro's beta weighs a quadratic penalty and must be >= 0, got {beta}")
    penalty = (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - 0.5 * beta * penalty).sum()


def gspo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    mask = inputs.get("sequence_ratio_mask")
    in_ratio = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask != 0
    if not bool(in_ratio.any()):
        raise LossError("gspo's sequence_ratio_mask marks no target: the sequence ratio is over none")
    sequence = (logprobs.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(sequence + logprobs - logprobs.detach())
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, _clip(ratio, inputs, config) * advantages).sum()


def stable_reinforce(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    sampler = inputs.get("sampler_logprobs")  # NaN where the target was not sampled (a prompt token)
    if sampler is None:
        raise LossError(
            "stable_reinforce needs each datum's provenance: sample with record_stability_info=True and "
            "attach the sequences' spans (Datum.with_provenance)"
        )
    sampled = ~torch.isnan(sampler)
    ratio = torch.exp(logprobs - torch.where(sampled, sampler, logprobs.detach()))
    low = config_number(config, "mask_low_threshold", 0.5)
    high = config_number(config, "mask_high_threshold", 2.0)
    if not 0 < low <= 1 <= high:
        raise LossError(
            f"stable_reinforce keeps the ratios in [mask_low_threshold, mask_high_threshold], which "
            f"must hold 1 (0 < low <= 1 <= high); got [{low}, {high}]"
        )
    keep = sampled & (ratio.detach() >= low) & (ratio.detach() <= high)
    return -(torch.where(keep, ratio, torch.zeros_like(ratio)) * inputs["advantages"]).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, Config], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}


# the loss_fn_inputs each loss reads besides the targets' (checked before the model runs: ``data.check_data``)
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
    # and the log-probs the sampler recorded, which the provenance names (``Datum.sampler_logprobs``)
    "stable_reinforce": ("advantages",),
}


def loss_fn(name: str) -> Callable[[torch.Tensor, Inputs, Config], torch.Tensor]:
    inputs_of(name)
    return LOSSES[name]


def inputs_of(name: str) -> tuple[str, ...]:
    """The inputs loss ``name`` needs; LossError for a loss this server does not compute."""
    if name not in LOSSES:
        raise LossError(f"unknown loss {name!r}; this server computes {', '.join(LOSSES)}")
    return INPUTS[name]
