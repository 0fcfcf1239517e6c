"""Decoding a serialized TrajectoryChunk into numpy arrays (the trainer's side of rollout/chunks.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import experience_pb2


@dataclass(frozen=True)
class ChunkArrays:
    policy_version: int
    env_incarnation: str
    observations: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape]
    log_probs: np.ndarray  # [T, N]
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    truncation_values: np.ndarray
    bootstrap_observations: np.ndarray  # [N, *obs_shape]
    bootstrap_values: np.ndarray  # [N]

    @property
    def num_steps(self) -> int:
        return int(self.rewards.size)


def decode_chunk(data: bytes) -> ChunkArrays:
    """Parse and check a chunk; raises ValueError on a malformed one (it is counted and skipped)."""
    chunk = experience_pb2.TrajectoryChunk.FromString(data)
    arrays = {
        name: tensors.decode(getattr(chunk, name))
        for name in (
            "observations",
            "actions",
            "log_probs",
            "values",
            "rewards",
            "terminated",
            "truncated",
            "truncation_values",
            "bootstrap_observations",
            "bootstrap_values",
        )
    }
    t_n = arrays["rewards"].shape
    if len(t_n) != 2 or any(
        arrays[k].shape[:2] != t_n
        for k in (
            "observations",
            "actions",
            "log_probs",
            "values",
            "terminated",
            "truncated",
            "truncation_values",
        )
    ):
        raise ValueError(f"chunk tensors disagree on [T, N]: { ({k: v.shape for k, v in arrays.items()}) }")
    return ChunkArrays(policy_version=chunk.policy_version, env_incarnation=chunk.env_incarnation, **arrays)
