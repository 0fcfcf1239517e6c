"""Where a policy network is chosen: the built-in MLP, or the user's class that ``trainer.model.network`` names
(``module:Class``). The trainer builds it to learn, and every rollout rebuilds it from the spec published with the
weights, so the module must be importable by both.

A user network subclasses ``ActorCritic`` and keeps its contract: ``__init__(spec)`` calls the parent's, then may
replace ``actor`` (normalised flat observations ``[B, obs_dim]`` to ``actor_outputs`` numbers: the logits, the
Gaussian's mean, or a squashed Gaussian's mean and log standard deviation) and ``critic`` (to one value), with any
modules. Everything else (normalisers, distributions, the algorithms' maths) stays the package's. A path that does
not import, a class of another kind, or a network whose outputs do not fit is refused here, in one line.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from tinker_atropos.models.mlp import ActorCritic


def network_class(reference: str) -> type[ActorCritic]:
    """The class ``trainer.model.network`` names; ValueError saying why it cannot be used."""
    if reference == "mlp":
        return ActorCritic
    module, _, name = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except Exception as error:  # ImportError, AttributeError, or whatever the module raises while imported
        raise ValueError(
            f"trainer.model.network {reference!r} does not import: {type(error).__name__}: {error}"
        ) from None
    if not (isinstance(found, type) and issubclass(found, ActorCritic)):
        raise ValueError(
            f"trainer.model.network {reference!r} is {found!r}, not a subclass of "
            "tinker_atropos.models.mlp.ActorCritic"
        )
    return found


def build_network(spec: dict[str, Any]) -> ActorCritic:
    """The network a spec describes, its outputs checked on a dummy batch; ValueError in one line otherwise."""
    reference = spec.get("network", "mlp")
    network_type = network_class(reference)
    try:
        network = network_type(spec)
    except Exception as error:  # the user's constructor
        raise ValueError(
            f"network {reference!r} cannot be built from its spec: {type(error).__name__}: {error}"
        ) from None
    if network_type is not ActorCritic:
        _check_outputs(network, reference)
    return network


@torch.no_grad()
def _check_outputs(network: ActorCritic, reference: str) -> None:
    observations = torch.zeros(2, network.obs_dim)
    try:
        normalised = network.normalize_obs(observations)
        outputs = {"actor": (network.actor(normalised), (2, network.actor_outputs))}
        if network.has_critic:
            outputs["critic"] = (network.critic(normalised), (2, 1))
    except Exception as error:
        raise ValueError(
            f"trainer.model.network {reference!r} fails on a batch of 2 observations: "
            f"{type(error).__name__}: {error}"
        ) from None
    for part, (output, expected) in outputs.items():
        if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(
                f"trainer.model.network {reference!r}: its {part} maps a batch of 2 observations to {got}, "
                f"expected {expected}"
            )
