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

Inputs = dict[str, torch.Tensor]
Config = dict[str, float | str]


class LossError(ValueError):
    """An unknown loss, or inputs it cannot be computed from: the client's error."""


def _need(inputs: Inputs, name: str, loss: str) -> torch.Tensor:
    if name not in inputs:
        raise LossError(f"loss {loss!r} needs loss_fn_inputs[{name!r}]; got {sorted(inputs)}")
    return inputs[name]


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
    ratio = torch.exp(logprobs - _need(inputs, "logprobs", "importance_sampling"))
    return -(ratio * _need(inputs, "advantages", "importance_sampling")).sum()


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(logprobs - _need(inputs, "logprobs", "ppo"))
    advantages = _need(inputs, "advantages", "ppo")
    low = _bound(inputs, config, "clip_low_threshold", 0.8)
    high = _bound(inputs, config, "clip_high_threshold", 1.2)
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, Config], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
}


def loss_fn(name: str) -> Callable[[torch.Tensor, Inputs, Config], torch.Tensor]:
    if name not in LOSSES:
        raise LossError(f"unknown loss {name!r}; this server computes {', '.join(LOSSES)}")
    return LOSSES[name]
