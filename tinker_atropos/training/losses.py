"""Tinker's built-in losses, as its documentation defines them: sums over every target of every datum (not
means), computed from the log-probabilities the model gives its targets.

- ``cross_entropy``: ``-(weights * target_logprobs).sum()`` (weights default to 1)
- ``importance_sampling``: ``-(exp(target_logprobs - logprobs) * advantages).sum()``, ``logprobs`` being the
  sampling policy's
- ``ppo``: the clipped surrogate ``-min(ratio * A, clip(ratio, low, high) * A).sum()`` with the ratio bounds
  ``clip_low_threshold`` / ``clip_high_threshold`` (per target in ``loss_fn_inputs`` or one value in
  ``loss_fn_config``), 0.8 and 1.2 by default (epsilon 0.2)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinker_atropos.training.data import ClientError

Inputs = dict[str, torch.Tensor]
Config = dict[str, float | str]


class LossError(ClientError):
    """An unknown loss, or inputs it cannot be computed from: the client's error."""


def _bound(inputs: Inputs, config: Config, name: str, default: float) -> torch.Tensor | float:
    if name in inputs:
        return inputs[name]
    value = config.get(name, default)
    if not isinstance(value, float):
        raise LossError(f"loss_fn_config[{name!r}] must be a number, got {value!r}")
    return value


def cross_entropy(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(logprobs if weights is None else logprobs * weights).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    low = _bound(inputs, config, "clip_low_threshold", 0.8)
    high = _bound(inputs, config, "clip_high_threshold", 1.2)
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, Config], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
}


# the loss_fn_inputs each loss reads besides the targets' (checked before the model runs: ``data.check_data``)
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}


def loss_fn(name: str) -> Callable[[torch.Tensor, Inputs, Config], torch.Tensor]:
    inputs_of(name)
    return LOSSES[name]


# losses the SDK names that this server refuses, and why (the client's error says so): a user of the cookbook,
# whose RL recipes default to stable_reinforce, learns what to set instead
UNSERVED = {
    "stable_reinforce": "Tinker publishes its inputs (samples recorded with record_stability_info, provenance "
    "spans naming them) but not its objective, so this server cannot compute what the hosted service does; "
    "train with loss_fn='importance_sampling' or 'ppo' (the cookbook: Config.loss_fn, AsyncConfig.loss_fn)",
}


def inputs_of(name: str) -> tuple[str, ...]:
    """The inputs loss ``name`` needs; LossError for a loss this server does not compute."""
    if name in UNSERVED:
        raise LossError(f"loss {name!r} is not served: {UNSERVED[name]}")
    if name not in LOSSES:
        raise LossError(f"unknown loss {name!r}; this server computes {', '.join(LOSSES)}")
    return INPUTS[name]
