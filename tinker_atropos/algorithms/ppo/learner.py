"""The PPO learner: trajectories in, one update of the training core out; it owns everything a checkpoint must
restore (the core's state, its minibatch RNG, the process RNGs)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tinker_atropos.algorithms.base import Experience, LearnerSetup
from tinker_atropos.algorithms.ppo.learning import Batch, compute_gae, learning_rate, ppo_update
from tinker_atropos.models.mlp import mlp_spec
from tinker_atropos.models.networks import build_network
from tinker_atropos.protocol.trajectory import Trajectory, contiguous_runs
from tinker_atropos.training.core import TrainingCore


class PPOLearner:
    experience: Experience = "trajectories"
    needs_values = True
    replay = None  # on-policy: each batch is learned from once

    def __init__(self, setup: LearnerSetup) -> None:
        self.hp = hp = setup.hyperparameters
        spec = mlp_spec(
            setup.observation_space,
            setup.action_space,
            setup.trainer.model,
            hp.normalize_observations,
            hp.normalize_returns,
            observation_layout=setup.observation_layout,
        )
        torch.manual_seed(setup.seed)
        self.core = TrainingCore(build_network(spec), spec, setup.device)
        self.generator = torch.Generator().manual_seed(setup.seed)
        self.env_steps = 0  # learned from so far: where the learning-rate annealing is

    def batch(self, trajectories: list[Trajectory]) -> Batch:
        """Advantages over each run of contiguous trajectories (``advantages``), then everything flattened to
        [B, …]."""
        parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("obs", "actions", "log_probs", "adv", "returns")
        }
        for run in contiguous_runs(trajectories):

            def along_time(name: str, run: list[Trajectory] = run) -> np.ndarray:
                return np.concatenate([getattr(c, name) for c in run])

            observations, actions = along_time("observations"), along_time("actions")
            advantages, returns = self.advantages(run, along_time)
            flat = advantages.size
            parts["obs"].append(observations.reshape(flat, *observations.shape[2:]))
            parts["actions"].append(actions.reshape(flat, *actions.shape[2:]))
            parts["log_probs"].append(along_time("log_probs").reshape(flat))
            parts["adv"].append(advantages.reshape(flat))
            parts["returns"].append(returns.reshape(flat))

        def tensor(name: str) -> torch.Tensor:
            return torch.as_tensor(np.concatenate(parts[name]), device=self.core.device)

        return Batch(tensor("obs"), tensor("actions"), tensor("log_probs"), tensor("adv"), tensor("returns"))

    def advantages(
        self, run: list[Trajectory], along_time: Callable[[str], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """GAE over one run, from the acting policy's values: (advantages, returns), time-major [T, N]."""
        return compute_gae(
            along_time("rewards"),
            along_time("values"),
            along_time("terminated"),
            along_time("truncated"),
            along_time("truncation_values"),
            run[-1].bootstrap_values,
            self.hp.gamma,
            self.hp.gae_lambda,
        )

    def learn(self, trajectories: list[Trajectory]) -> dict[str, float]:
        step_size = learning_rate(self.hp, self.env_steps)
        figures = ppo_update(self.core, self.batch(trajectories), self.hp, self.generator, step_size)
        steps = sum(t.num_steps for t in trajectories)
        # data-parallel learners: each learnt its share of the batch, and each anneals by the whole batch
        self.env_steps += steps if self.core.group is None else self.core.group.count(steps)
        return figures

    def state_dict(self) -> dict[str, Any]:
        return {
            "core": self.core.state_dict(),
            "env_steps": self.env_steps,
            "rng": {
                "generator": self.generator.get_state(),
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state["core"])
        self.env_steps = state.get("env_steps", 0)  # checkpoints before annealing: from the start
        rng = state["rng"]
        self.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
