"""One step of all the instances of a session, typed, and its wire form (``StepResult``), encoded and decoded
here only: backends produce it, the env service encodes it, the env client decodes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2

TENSORS = ("observations", "rewards", "terminated", "truncated", "final_observations", "final_indices")


@dataclass(frozen=True)
class StepBatch:
    """What one step of all instances produced.

    ``observations`` holds, for an instance whose episode just ended, the first observation of its next
    episode; the terminal observation is kept apart in ``final_observations`` (rows in the order of
    ``final_indices``), so a learner can bootstrap a truncated episode from it. The arrays are the receiver's:
    nobody writes into them afterwards.
    """

    observations: np.ndarray  # [N, *obs_shape] float32
    rewards: np.ndarray  # [N] float32
    terminated: np.ndarray  # [N] bool
    truncated: np.ndarray  # [N] bool
    final_observations: np.ndarray  # [K, *obs_shape] float32
    final_indices: np.ndarray  # [K] int32, the instances whose episode ended, ascending
    episodes: Sequence[environment_pb2.EpisodeEnd] = field(default=(), repr=False)  # those that ended

    def encode(self, episodes: Sequence[environment_pb2.EpisodeEnd]) -> environment_pb2.StepResult:
        arrays = {name: tensors.encode(getattr(self, name)) for name in TENSORS}
        return environment_pb2.StepResult(episodes=episodes, **arrays)

    @classmethod
    def decode(cls, result: environment_pb2.StepResult) -> StepBatch:
        return cls(
            episodes=result.episodes, **{name: tensors.decode(getattr(result, name)) for name in TENSORS}
        )

    def truncated_finals(self) -> tuple[np.ndarray, np.ndarray]:
        """(instances whose episode the time limit cut at this step, their final observations)."""
        cut = self.truncated[self.final_indices]
        return self.final_indices[cut], self.final_observations[cut]
