"""Per-instance episode return and length, reported when an episode ends; how evaluations share episodes."""

from __future__ import annotations

import numpy as np

from tinker_atropos.protocol.v1 import environment_pb2


class EpisodeTracker:
    def __init__(self, num_instances: int) -> None:
        self.returns = np.zeros(num_instances, dtype=np.float64)
        self.lengths = np.zeros(num_instances, dtype=np.int64)

    def update(
        self,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        cut_nonfinite: np.ndarray | None = None,
    ) -> list[environment_pb2.EpisodeEnd]:
        """Add a step; the episodes it ended. ``cut_nonfinite`` marks those a NaN or infinity ended."""
        self.returns += rewards
        self.lengths += 1
        ended = []
        for i in np.flatnonzero(terminated | truncated):
            ended.append(
                environment_pb2.EpisodeEnd(
                    instance=int(i),
                    episode_return=float(self.returns[i]),
                    length=int(self.lengths[i]),
                    terminated=bool(terminated[i]),
                    cut_nonfinite=cut_nonfinite is not None and bool(cut_nonfinite[i]),
                )
            )
            self.returns[i] = 0.0
            self.lengths[i] = 0
        return ended


def equal_shares(episodes: int, instances: int) -> np.ndarray:
    """How many of ``episodes`` each instance plays: equal shares, so short episodes are not over-counted (an
    instance whose episodes are short would otherwise finish more of them first), as SB3's evaluate_policy."""
    return np.array([episodes // instances + (i < episodes % instances) for i in range(instances)])
