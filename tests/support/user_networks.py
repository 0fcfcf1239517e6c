"""User networks for tests/services/test_networks.py, as a researcher would write them: ActorCritic subclasses that swap the
actor and critic modules, named in a config as ``trainer.model.network: tests.support.user_networks:Class``."""

from __future__ import annotations

from typing import Any

from torch import nn

from tinker_atropos.models.mlp import ActorCritic


class LayerNormActorCritic(ActorCritic):
    """Actor and critic with a LayerNorm after each hidden layer (modules the built-in MLP never has)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)

        def trunk(n_out: int) -> nn.Sequential:
            width = spec["hidden_sizes"][0]
            return nn.Sequential(
                nn.Linear(self.obs_dim, width), nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, n_out)
            )

        self.actor = trunk(self.actor_outputs)
        if self.has_critic:
            self.critic = trunk(1)


class WrongOutputs(ActorCritic):
    """Breaks the contract: its actor gives one number whatever the action space."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.actor = nn.Linear(self.obs_dim, 1)


class NotANetwork:
    """Not an ActorCritic at all."""
