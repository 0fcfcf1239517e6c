"""SAC's maths, top to bottom (Haarnoja et al. 2018, as CleanRL's sac_continuous_action): one gradient step of the
twin soft Q critics, the squashed-Gaussian actor and the entropy temperature, then the Polyak step of the targets.

Actions enter the critics in the actor's [-1, 1] units (the env's bounds scaled away), so that one learning rate
suits every task. A terminated step's target is its reward; a truncated one was stored with its true final
observation (``training/replay.py``) and is bootstrapped like any other step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tinker_atropos.algorithms.sac.config import SACConfig
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.training.core import AdamParams, TrainingCore
from tinker_atropos.training.replay import Transitions


class TwinQ(nn.Module):
    """Two independent Q(s, a) networks; the smaller of their estimates curbs overestimation. They run as one
    batched network (each layer one ``baddbmm`` over both), half the operations of two: at SAC's small batches
    the cost of a step is the number of operations, not the arithmetic."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: list[int], activation: str) -> None:
        super().__init__()
        sizes = [obs_dim + action_dim, *hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for depth, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            gain = 1.0 if depth == len(sizes) - 2 else math.sqrt(2)
            weight = torch.empty(2, n_in, n_out)
            for member in weight:  # orthogonal per network, as ``build_mlp`` initialises a layer
                nn.init.orthogonal_(member.T, gain)
            self.weights.append(nn.Parameter(weight))
            self.biases.append(nn.Parameter(torch.zeros(2, 1, n_out)))
        self.activation = {"tanh": torch.tanh, "relu": torch.relu}[activation]

    def forward(self, obs: torch.Tensor, unit_actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, unit_actions], dim=-1).expand(2, -1, -1)
        last = len(self.weights) - 1
        for depth, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.baddbmm(bias, x, weight)
            if depth < last:
                x = self.activation(x)
        return x[0, :, 0], x[1, :, 0]


@dataclass
class Critics:
    """What SAC learns beside the published actor: the critics, their targets, the temperature, their Adams."""

    q: TwinQ
    target: TwinQ
    q_optimizer: torch.optim.Optimizer
    log_alpha: torch.Tensor  # a parameter when the temperature is tuned
    alpha_optimizer: torch.optim.Optimizer | None
    target_entropy: float


@torch.no_grad()
def soft_bellman_target(
    actor: ActorCritic,
    target_critics: TwinQ,
    alpha: torch.Tensor,
    rewards: torch.Tensor,
    next_obs: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """r + gamma (1 - terminated) (min Q_target(s', a') - alpha log pi(a' | s')), a' drawn from the current actor
    at the next observation (for a truncated step, the episode's final one)."""
    next_actions, next_log_prob = actor.squashed_sample(next_obs)
    soft_value = torch.min(*target_critics(next_obs, next_actions)) - alpha * next_log_prob
    return rewards + gamma * (1.0 - terminated) * soft_value


def sac_step(core: TrainingCore, critics: Critics, batch: Transitions, hp: SACConfig) -> dict[str, float]:
    actor: ActorCritic = core.model
    obs, next_obs = actor.normalize_obs(batch.observations), actor.normalize_obs(batch.next_observations)
    actions = actor.to_unit_actions(batch.actions)
    alpha = critics.log_alpha.detach().exp()

    # 1. critics: regress both Q towards the soft Bellman target
    target = soft_bellman_target(
        actor, critics.target, alpha, batch.rewards, next_obs, batch.terminated, hp.gamma
    )
    q1, q2 = critics.q(obs, actions)
    q_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
    critics.q_optimizer.zero_grad(set_to_none=True)
    q_loss.backward()
    critics.q_optimizer.step()

    # 2. actor: maximise the smaller Q minus alpha log pi, through the reparameterised sample
    log_prob = torch.empty(0)

    def actor_loss(model: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        nonlocal log_prob
        sampled, log_prob = model.squashed_sample(obs)
        loss = (alpha * log_prob - torch.min(*critics.q(obs, sampled))).mean()
        return loss, {"actor_loss": loss.item()}

    critics.q.requires_grad_(False)  # the actor's loss moves the actor only: no gradients into the critics
    try:
        metrics = core.forward_backward(actor_loss)
    finally:
        critics.q.requires_grad_(True)
    core.optim_step(AdamParams(hp.policy_learning_rate))

    # 3. temperature: towards the target entropy
    if critics.alpha_optimizer is not None:
        alpha_loss = -(critics.log_alpha.exp() * (log_prob.detach() + critics.target_entropy)).mean()
        critics.alpha_optimizer.zero_grad(set_to_none=True)
        alpha_loss.backward()
        critics.alpha_optimizer.step()

    # 4. targets: a Polyak step towards the critics
    with torch.no_grad():
        torch._foreach_lerp_(list(critics.target.parameters()), list(critics.q.parameters()), hp.tau)
    return {
        **metrics,
        "q_loss": q_loss.item(),
        "q_value": q1.mean().item(),
        "entropy": -log_prob.mean().item(),
        "alpha": alpha.item(),
    }
