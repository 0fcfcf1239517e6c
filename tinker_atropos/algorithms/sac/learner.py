"""The SAC learner: chunks go into the trainer's replay buffer, and every ``learn`` makes the gradient steps the
update-to-data ratio owes for the env steps received (none before ``learning_starts``). The rollouts act with the
actor alone (a squashed Gaussian, published as the core's model); critics, targets and temperature stay here.

A chunk of any age is learned from (off-policy: it is never stale). The trainer takes the next chunks only after
their gradient steps, so when it falls behind, chunks queue in Redis and rollouts with ``flow_control: pause``
wait: the ratio holds, measured in the ``utd_ratio`` figure, instead of drifting with the collection speed."""

from __future__ import annotations

import copy
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from tinker_atropos.algorithms.base import Experience, LearnerSetup
from tinker_atropos.algorithms.sac.learning import Critics, TwinQ, sac_step
from tinker_atropos.models.mlp import mlp_spec
from tinker_atropos.models.networks import build_network
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.training.core import TrainingCore
from tinker_atropos.training.replay import ReplayBuffer


class SACLearner:
    experience: Experience = "transitions"
    needs_values = False

    def __init__(self, setup: LearnerSetup) -> None:
        if not isinstance(setup.action_space, gym.spaces.Box):
            raise ValueError(
                f"SAC acts in bounded Box action spaces, not {setup.action_space}: use ppo or appo"
            )
        self.hp = hp = setup.hyperparameters
        model = setup.trainer.model
        spec = mlp_spec(
            setup.observation_space,
            setup.action_space,
            model,
            normalize_observations=False,
            normalize_returns=False,
            critic=False,
            squashed=True,
            observation_layout=setup.observation_layout,
        )
        torch.manual_seed(setup.seed)
        self.core = TrainingCore(build_network(spec), spec, setup.device)
        obs_dim = int(np.prod(setup.observation_space.shape))
        action_dim = int(np.prod(setup.action_space.shape))
        q = TwinQ(obs_dim, action_dim, list(model.hidden_sizes), model.activation).to(setup.device)
        log_alpha = torch.tensor(
            math.log(hp.alpha or 1.0), device=setup.device, requires_grad=hp.alpha is None
        )
        self.critics = Critics(
            q=q,
            target=copy.deepcopy(q).requires_grad_(False),
            q_optimizer=torch.optim.Adam(q.parameters(), lr=hp.q_learning_rate, fused=True),
            log_alpha=log_alpha,
            alpha_optimizer=torch.optim.Adam([log_alpha], lr=hp.policy_learning_rate)
            if hp.alpha is None
            else None,
            target_entropy=-float(action_dim) if hp.target_entropy is None else hp.target_entropy,
        )
        self.replay = ReplayBuffer(
            hp.buffer_size, tuple(setup.observation_space.shape), tuple(setup.action_space.shape)
        )
        self.generator = np.random.default_rng(setup.seed)
        self.env_steps = 0  # received since learning started: what the gradient steps are owed for
        self.gradient_steps = 0
        self.owed = 0.0  # gradient steps owed and not yet made (the fraction of one, between updates)

    def learn(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        for trajectory in trajectories:
            added = self.replay.add(trajectory)
            if len(self.replay) >= self.hp.learning_starts:
                self.env_steps += added
                self.owed += self.hp.utd_ratio * added
        steps = int(self.owed)
        self.owed -= steps
        sums: dict[str, float] = defaultdict(float)
        for _ in range(steps):
            batch = self.replay.sample(self.hp.batch_size, self.generator, self.core.device)
            for name, value in sac_step(self.core, self.critics, batch, self.hp).items():
                sums[name] += value
        self.gradient_steps += steps
        return {
            **{name: total / steps for name, total in sums.items()},
            "gradient_steps": float(self.gradient_steps),
            "utd_ratio": self.gradient_steps / max(self.env_steps, 1),
            "replay_size": float(len(self.replay)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything but the replay buffer (the trainer checkpoints it beside): what an undone update restores."""
        critics = self.critics
        return {
            "core": self.core.state_dict(),
            "q": critics.q.state_dict(),
            "target": critics.target.state_dict(),
            "q_optimizer": critics.q_optimizer.state_dict(),
            "log_alpha": critics.log_alpha.detach().clone(),
            "alpha_optimizer": critics.alpha_optimizer.state_dict() if critics.alpha_optimizer else None,
            "counters": {
                "env_steps": self.env_steps,
                "gradient_steps": self.gradient_steps,
                "owed": self.owed,
            },
            "rng": {
                "generator": self.generator.bit_generator.state,
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        critics = self.critics
        self.core.load_state_dict(state["core"])
        critics.q.load_state_dict(state["q"])
        critics.target.load_state_dict(state["target"])
        critics.q_optimizer.load_state_dict(state["q_optimizer"])
        with torch.no_grad():
            critics.log_alpha.copy_(state["log_alpha"])
        if critics.alpha_optimizer is not None and state["alpha_optimizer"] is not None:
            critics.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        counters = state["counters"]
        self.env_steps, self.gradient_steps = counters["env_steps"], counters["gradient_steps"]
        self.owed = counters["owed"]
        rng = state["rng"]
        self.generator.bit_generator.state = rng["generator"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
