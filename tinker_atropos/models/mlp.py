"""MLP policies for Box (Gaussian, or tanh-squashed Gaussian within the space's bounds) and Discrete (categorical)
action spaces, with or without a critic.

Any algorithm may learn them; a rollout acts with them knowing only their spec (``models.acting``). The
observation normaliser and the return normaliser are buffers of the network, so the weights a rollout loads carry
exactly the normalisation the trainer used: the policy is one self-contained function of the raw observation.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Normal

from tinker_atropos.models.encoders import ObservationEncoder
from tinker_atropos.models.spec import (
    LOG_STD_MAX,
    LOG_STD_MIN,
    MODEL,
    RMS_EPSILON,
    action_layout,
    squash_bounds,
)


def mlp_spec(
    observation_space: gym.Space,
    action_space: gym.Space,
    model: Any,
    normalize_observations: bool,
    normalize_returns: bool,
    critic: bool = True,
    squashed: bool = False,
    observation_layout: gym.spaces.Dict | None = None,
) -> dict[str, Any]:
    """The JSON-able description that rebuilds the network (published with its weights). ``model`` is the
    config's ``trainer.model`` section. ``squashed``: a Box action is tanh(Gaussian) scaled to the space's
    bounds, its standard deviation an output of the actor (SAC's policy). ``observation_layout``: the Dict a
    Dict env observes as ``observation_space`` (its flat Box); its entries, like an image observation (H x W x C),
    get encoders (``models.encoders``)."""
    if isinstance(action_space, gym.spaces.Box):
        action: dict[str, Any] = {"kind": "box", "shape": list(action_space.shape)}
        if squashed:
            if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
                raise ValueError(f"a squashed policy needs a bounded Box action space, not {action_space}")
            low, high = action_space.low.astype(np.float64), action_space.high.astype(np.float64)
            action.update(squash=True, low=low.ravel().tolist(), high=high.ravel().tolist())
    elif isinstance(action_space, gym.spaces.Discrete):
        action = {"kind": "discrete", "n": int(action_space.n), "start": int(action_space.start)}
    else:
        raise ValueError(f"MLP policies act in Box and Discrete action spaces, not {action_space}")
    if observation_layout is not None:
        layout = [[key, list(entry.shape)] for key, entry in observation_layout.spaces.items()]
    elif len(observation_space.shape) == 3:  # an image
        layout = [["", list(observation_space.shape)]]
    else:
        layout = None
    return {
        "model": MODEL,
        "network": model.network,  # "mlp", or the user's ActorCritic subclass (``models.networks``)
        "obs_shape": list(observation_space.shape),
        "action": action,
        "hidden_sizes": list(model.hidden_sizes),
        "activation": model.activation,
        "init_log_std": model.init_log_std,
        "normalize_observations": normalize_observations,
        "normalize_returns": normalize_returns,
        "critic": critic,
        **({"obs_layout": layout} if layout else {}),  # absent: the flat observation feeds the MLPs
    }


class Summing(Protocol):
    """What sums a tensor over data-parallel learners (``training.data_parallel.Group``)."""

    def sum(self, value: torch.Tensor) -> torch.Tensor: ...


class RunningMeanStd(nn.Module):
    """Mean and variance over everything seen so far (parallel-variance update), kept in float64."""

    def __init__(self, shape: tuple[int, ...], epsilon: float = 1e-4) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor, group: Summing | None = None) -> None:
        """Take in the rows of ``x``; with a ``group`` of data-parallel learners, every learner's rows (each holds
        its own share of the batch), so that all of them keep the same statistics."""
        x = x.to(torch.float64)
        if group is None:
            batch_mean, batch_count = x.mean(0), x.shape[0]
            batch_var = (x - batch_mean).square().mean(0)  # 2x faster than x.var(0) on [4096, 348] float64
        else:  # the same two passes over every learner's rows: their count and sum, then the squares about the mean
            counted = group.sum(torch.cat([x.new_tensor([x.shape[0]]), x.sum(0).reshape(-1)]))
            batch_count = counted[0]
            batch_mean = (counted[1:] / batch_count).view_as(self.mean)
            batch_var = group.sum((x - batch_mean).square().sum(0)) / batch_count
        delta = batch_mean - self.mean
        total = self.count + batch_count
        self.mean += delta * batch_count / total
        m2 = (
            self.var * self.count
            + batch_var * batch_count
            + delta.square() * self.count * batch_count / total
        )
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def std(self) -> torch.Tensor:
        return torch.sqrt(self.var + RMS_EPSILON).to(torch.float32)


def _layer(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def build_mlp(n_in: int, hidden: list[int], n_out: int, activation: str, out_std: float) -> nn.Sequential:
    """Linear layers with orthogonal initialisation (CleanRL's), ``activation`` between them."""
    act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [_layer(n_in, width, math.sqrt(2)), act()]
        n_in = width
    layers.append(_layer(n_in, n_out, out_std))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        obs_dim = int(np.prod(spec["obs_shape"]))
        action = action_layout(spec)
        self.discrete, self.action_start = action.discrete, action.start
        self.squashed, n_out = action.squashed, action.n
        hidden, activation = spec["hidden_sizes"], spec["activation"]
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.return_rms = RunningMeanStd(())
        self.has_critic = bool(spec.get("critic", True))
        # built first, as before critics were optional: the parameters a seed gives stay the same
        # structured observations (a Dict's entries, an image): each head gets its own encoder before its MLP
        layout = spec.get("obs_layout")
        self.encoded = layout is not None

        def head(n_out: int, out_std: float) -> nn.Sequential:
            if layout is None:
                return build_mlp(obs_dim, hidden, n_out, activation, out_std)
            encoder = ObservationEncoder(layout)
            return nn.Sequential(encoder, build_mlp(encoder.out_dim, hidden, n_out, activation, out_std))

        self.critic = head(1, out_std=1.0) if self.has_critic else None
        self.obs_dim = obs_dim
        self.actor_outputs = action.actor_outputs  # what ``actor`` maps a normalised observation to
        self.actor = head(self.actor_outputs, out_std=0.01)
        if self.squashed:
            mid, half_range = squash_bounds(spec)
            self.register_buffer("action_mid", torch.from_numpy(mid), persistent=False)
            self.register_buffer("action_half_range", torch.from_numpy(half_range), persistent=False)
        elif not self.discrete:
            self.actor_logstd = nn.Parameter(torch.full((1, n_out), float(spec["init_log_std"])))

    def normalize_obs(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs.flatten(1)
        if not self.spec["normalize_observations"]:
            return obs
        return ((obs - self.obs_rms.mean.float()) / self.obs_rms.std()).clamp(-10.0, 10.0)

    def normalized_value(self, norm_obs: torch.Tensor) -> torch.Tensor:
        """Critic output in the return normaliser's units (what the value loss compares)."""
        return self.critic(norm_obs).squeeze(-1)

    def denormalize_value(self, value: torch.Tensor) -> torch.Tensor:
        if not self.spec["normalize_returns"]:
            return value
        return value * self.return_rms.std() + self.return_rms.mean.float()

    def normalize_return(self, returns: torch.Tensor) -> torch.Tensor:
        if not self.spec["normalize_returns"]:
            return returns
        return (returns - self.return_rms.mean.float()) / self.return_rms.std()

    def distribution(self, norm_obs: torch.Tensor) -> Distribution:
        out = self.actor(norm_obs)
        # argument validation costs more than the small MLP itself on every step and minibatch
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)

    def log_prob(self, dist: Distribution, actions: torch.Tensor) -> torch.Tensor:
        """Log-probability of env actions (a Discrete space's start included)."""
        if self.discrete:
            return dist.log_prob(actions - self.action_start)
        return dist.log_prob(actions).sum(-1)

    def entropy(self, dist: Distribution) -> torch.Tensor:
        ent = dist.entropy()
        return ent if self.discrete else ent.sum(-1)

    def evaluate(
        self, norm_obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For the loss, on normalised observations: (log-probs of ``actions``, entropy, normalised value or
        None without a critic)."""
        dist = self.distribution(norm_obs)
        value = self.normalized_value(norm_obs) if self.has_critic else None
        return self.log_prob(dist, actions), self.entropy(dist), value

    def mode(self, norm_obs: torch.Tensor) -> torch.Tensor:
        """The policy's most likely env action: the top class (its start added), the Gaussian's mean, or tanh of
        the mean scaled to the bounds for a squashed policy. What evaluation and exported policies act with."""
        out = self.actor(norm_obs)
        if self.discrete:
            return out.argmax(dim=-1) + self.action_start
        if self.squashed:
            mean = out[..., : self.actor_outputs // 2]
            return self.action_mid + self.action_half_range * torch.tanh(mean)
        return out

    def squashed_sample(self, norm_obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised draw of a squashed policy: (action in [-1, 1], its log-probability), the change of
        variables through tanh included."""
        mean, log_std = self.actor(norm_obs).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        pre_tanh = mean + log_std.exp() * torch.randn_like(mean)
        action = torch.tanh(pre_tanh)
        log_prob = Normal(mean, log_std.exp(), validate_args=False).log_prob(pre_tanh)
        return action, (log_prob - torch.log1p(-action.square() + 1e-6)).sum(-1)

    def to_unit_actions(self, env_actions: torch.Tensor) -> torch.Tensor:
        """A squashed policy's env actions (within the space's bounds) as the [-1, 1] actions it sampled."""
        return (env_actions - self.action_mid) / self.action_half_range
