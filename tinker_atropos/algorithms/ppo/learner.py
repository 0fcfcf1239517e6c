"""The PPO learner: turns accepted chunks into one update and owns everything a checkpoint must restore."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from tinker_atropos.algorithms.ppo.learning import Batch, compute_gae, ppo_update
from tinker_atropos.algorithms.ppo.networks import ActorCritic, weights_to_bytes
from tinker_atropos.config import TrainerSection
from tinker_atropos.protocol.chunks import ChunkArrays


def contiguous_runs(chunks: list[ChunkArrays]) -> list[list[ChunkArrays]]:
    """Group chunks that continue one another: a chunk whose first observations are exactly another's bootstrap
    observations comes from the same session, right after it.

    GAE then runs over a whole run as over one long rollout. Cut at every chunk, a quarter of the advantage
    weight of 64-step chunks would rest on bootstrapped values instead of rewards (with gamma 0.99, lambda 0.95).
    """
    runs: list[list[ChunkArrays]] = []
    run_ending_at: dict[bytes, int] = {}  # bootstrap observations -> the run they end
    for chunk in chunks:
        index = run_ending_at.pop(chunk.observations[0].tobytes(), None)
        if index is None or runs[index][-1].observations.shape[1:] != chunk.observations.shape[1:]:
            index = len(runs)
            runs.append([])
        runs[index].append(chunk)
        run_ending_at[chunk.bootstrap_observations.tobytes()] = index
    return runs


class PPOLearner:
    def __init__(self, spec: dict[str, Any], config: TrainerSection, device: torch.device, seed: int) -> None:
        self.spec, self.hp, self.device = spec, config.ppo, device
        torch.manual_seed(seed)
        self.model = ActorCritic(spec).to(device)
        # fused: one kernel per step for all parameters (not the default on CPU); PPO updates of Humanoid took
        # 0.93x the CPU time of foreach, which was itself faster than one kernel per parameter tensor
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=self.hp.learning_rate, eps=1e-5, fused=True
        )
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, chunks: list[ChunkArrays]) -> Batch:
        """Advantages over each run of contiguous chunks, then everything flattened to [B, …]."""
        parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("obs", "actions", "log_probs", "adv", "returns")
        }
        for run in contiguous_runs(chunks):

            def along_time(name: str, run: list[ChunkArrays] = run) -> np.ndarray:
                return np.concatenate([getattr(c, name) for c in run])

            rewards = along_time("rewards")
            advantages, returns = compute_gae(
                rewards,
                along_time("values"),
                along_time("terminated"),
                along_time("truncated"),
                along_time("truncation_values"),
                run[-1].bootstrap_values,
                self.hp.gamma,
                self.hp.gae_lambda,
            )
            observations, actions = along_time("observations"), along_time("actions")
            flat = rewards.size
            parts["obs"].append(observations.reshape(flat, *observations.shape[2:]))
            parts["actions"].append(actions.reshape(flat, *actions.shape[2:]))
            parts["log_probs"].append(along_time("log_probs").reshape(flat))
            parts["adv"].append(advantages.reshape(flat))
            parts["returns"].append(returns.reshape(flat))

        def tensor(name: str) -> torch.Tensor:
            return torch.as_tensor(np.concatenate(parts[name]), device=self.device)

        return Batch(tensor("obs"), tensor("actions"), tensor("log_probs"), tensor("adv"), tensor("returns"))

    def update(self, chunks: list[ChunkArrays]) -> dict[str, float]:
        return ppo_update(self.model, self.optimizer, self.batch(chunks), self.hp, self.generator)

    def weights(self) -> bytes:
        return weights_to_bytes(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {
                "generator": self.generator.get_state(),
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng = state["rng"]
        self.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
