"""A second algorithm, from outside the package: vanilla policy gradient (REINFORCE with reward-to-go and a
normalised-return baseline) on an actor-only MLP. Named in a config as
``trainer.algorithm: tests.support.toy_algorithm:toy_pg``, hyper-parameters under ``trainer.toy_pg``.

It proves the seam: registered here, it trains through ``up`` without a line of ``trainer/`` or ``rollout/``
knowing it, and its critic-less policy makes the rollouts write trajectories without values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from tinker_atropos.algorithms.base import Algorithm, LearnerSetup, register
from tinker_atropos.models.mlp import ActorCritic, mlp_spec
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.sections import Section
from tinker_atropos.training.core import AdamParams, TrainingCore


class ToyPGConfig(Section):
    learning_rate: float = Field(3e-3, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)


def rewards_to_go(trajectory: Trajectory, gamma: float) -> np.ndarray:
    """Discounted return from each step to its episode's end (or the chunk's: there is no critic to bootstrap)."""
    done = trajectory.terminated | trajectory.truncated
    returns = np.zeros_like(trajectory.rewards)
    running = np.zeros(trajectory.rewards.shape[1], np.float32)
    for t in reversed(range(len(returns))):
        running = trajectory.rewards[t] + gamma * running * (1.0 - done[t])
        returns[t] = running
    return returns


class ToyPGLearner:
    experience = "trajectories"
    needs_values = False
    replay = None

    def __init__(self, setup: LearnerSetup) -> None:
        self.hp = setup.hyperparameters
        spec = mlp_spec(
            setup.observation_space,
            setup.action_space,
            setup.trainer.model,
            normalize_observations=False,
            normalize_returns=False,
            critic=False,
        )
        torch.manual_seed(setup.seed)
        self.core = TrainingCore(ActorCritic(spec), spec, setup.device)

    def learn(self, trajectories: list[Trajectory]) -> dict[str, float]:
        def flat(arrays: list[np.ndarray]) -> torch.Tensor:
            joined = np.concatenate([a.reshape(-1, *a.shape[2:]) for a in arrays])
            return torch.as_tensor(joined, device=self.core.device)

        observations = flat([t.observations for t in trajectories])
        actions = flat([t.actions for t in trajectories])
        returns = flat([rewards_to_go(t, self.hp.gamma) for t in trajectories])
        advantages = (returns - returns.mean()) / (returns.std() + 1e-8)

        def loss(model: ActorCritic) -> tuple[torch.Tensor, dict[str, float]]:
            dist = model.distribution(model.normalize_obs(observations))
            policy_loss = -(model.log_prob(dist, actions) * advantages).mean()
            return policy_loss, {"policy_loss": policy_loss.item()}

        metrics = self.core.forward_backward(loss)
        return metrics | self.core.optim_step(AdamParams(learning_rate=self.hp.learning_rate))

    def state_dict(self) -> dict[str, Any]:
        return {"core": self.core.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state["core"])


register(Algorithm("toy_pg", ToyPGConfig, f"{__name__}:ToyPGLearner", "REINFORCE, for the tests"))
