"""PPO learning, top to bottom: advantages with GAE, then clipped-objective epochs over minibatches, each a
``forward_backward`` and an ``optim_step`` of the training core."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from tinker_atropos.algorithms.ppo.config import ClippedObjectiveConfig
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.trainer.core import AdamParams, TrainingCore


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    truncation_values: np.ndarray,
    bootstrap_values: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over time-major [T, N] arrays; returns (advantages, returns).

    A terminated step has no future. A truncated step (time limit) still has one: its reward is completed by
    gamma * V(final observation), then the recursion restarts, since the next row belongs to a new episode.
    """
    steps = rewards.shape[0]
    rewards = rewards + gamma * truncation_values * truncated
    episode_goes_on = 1.0 - (terminated | truncated).astype(np.float32)
    advantages = np.zeros_like(rewards, dtype=np.float32)
    last_advantage = np.zeros(rewards.shape[1], dtype=np.float32)
    for t in reversed(range(steps)):
        next_values = bootstrap_values if t == steps - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_values * episode_goes_on[t] - values[t]
        last_advantage = delta + gamma * gae_lambda * episode_goes_on[t] * last_advantage
        advantages[t] = last_advantage
    return advantages, advantages + values


@dataclass
class Batch:
    """Flattened experience of one update: [B, …] tensors."""

    observations: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def rows(self, index: torch.Tensor | slice) -> Batch:
        """The same rows of every field: gathered for an index tensor, views for a slice."""
        if isinstance(index, slice):
            return Batch(*(getattr(self, f.name)[index] for f in fields(self)))
        # index_select, not advanced indexing: 5x faster for these [4096, 348] float rows on a CPU
        return Batch(*(getattr(self, f.name).index_select(0, index) for f in fields(self)))


def ppo_loss(
    model: ActorCritic, minibatch: Batch, hp: ClippedObjectiveConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate, value and entropy terms on a minibatch whose observations and returns are
    already normalised."""
    new_log_probs, entropy, new_values = model.evaluate(minibatch.observations, minibatch.actions)
    log_ratio = new_log_probs - minibatch.log_probs
    ratio = log_ratio.exp()

    advantages = minibatch.advantages
    if hp.normalize_advantages and len(advantages) > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss = torch.max(
        -advantages * ratio, -advantages * ratio.clamp(1 - hp.clip_coef, 1 + hp.clip_coef)
    ).mean()

    value_loss = 0.5 * (new_values - minibatch.returns).square().mean()
    entropy_loss = entropy.mean()
    loss = policy_loss - hp.ent_coef * entropy_loss + hp.vf_coef * value_loss

    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean().item()
        clip_fraction = ((ratio - 1).abs() > hp.clip_coef).float().mean().item()
    stats = {
        "policy_loss": policy_loss.item(),
        "value_loss": value_loss.item(),
        "entropy": entropy_loss.item(),
        "approx_kl": approx_kl,
        "clip_fraction": clip_fraction,
    }
    return loss, stats


def adam_params(hp: ClippedObjectiveConfig) -> AdamParams:
    """Adam as CleanRL's PPO sets it: eps 1e-5, the global gradient norm clipped first."""
    return AdamParams(learning_rate=hp.learning_rate, eps=1e-5, grad_clip_norm=hp.max_grad_norm)


def ppo_update(
    core: TrainingCore, batch: Batch, hp: ClippedObjectiveConfig, generator: torch.Generator
) -> dict[str, float]:
    """Update the normalisers on the new batch, then ``update_epochs`` passes of minibatch gradient steps."""
    model: ActorCritic = core.model
    if model.spec["normalize_observations"]:
        model.obs_rms.update(batch.observations.flatten(1))
    if model.spec["normalize_returns"]:
        model.return_rms.update(batch.returns)

    # The normalisers stay fixed through the epochs, so observations and value targets are normalised once.
    batch = replace(
        batch,
        observations=model.normalize_obs(batch.observations),
        returns=model.normalize_return(batch.returns),
    )
    size = batch.observations.shape[0]
    minibatch = max(1, size // hp.num_minibatches)
    adam = adam_params(hp)
    totals: dict[str, float] = {}
    count = 0
    for _epoch in range(hp.update_epochs):
        # One gather per epoch; its minibatches are then contiguous views.
        shuffled = batch.rows(torch.randperm(size, generator=generator).to(batch.observations.device))
        for start in range(0, size - minibatch + 1, minibatch):
            rows = shuffled.rows(slice(start, start + minibatch))
            stats = core.forward_backward(lambda m, rows=rows: ppo_loss(m, rows, hp))
            core.optim_step(adam)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            count += 1
        if hp.target_kl is not None and stats["approx_kl"] > hp.target_kl:
            break
    return {k: v / count for k, v in totals.items()}
