"""Stream entries in, batches of ``trainer.samples_per_update`` env steps out, for the experience loop.

Every record is checked (``decode_trajectory``: a bad one is skipped and counted by reason) and taken once
(``protocol/freshness.py``); for an on-policy learner, one more than ``trainer.max_policy_lag`` versions old is
rejected as stale and counted (an off-policy learner's replay takes chunks of any age). The policy lag of each chunk
taken is measured. A chunk acted by a version above the trainer's is refused, its version noted (``ahead``): the
loop then asks whether the rollouts hold newer weights than its own.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from tinker_atropos.algorithms.base import Learner
from tinker_atropos.config import TrainerSection
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.protocol.trajectory import RecordError, Trajectory, TrajectorySpec, decode_trajectory
from tinker_atropos.trainer.figures import LagMeter


class Batcher:
    def __init__(self, trainer: TrainerSection, algorithm: str) -> None:
        self.samples_per_update, self.max_policy_lag = trainer.samples_per_update, trainer.max_policy_lag
        self.algorithm = algorithm
        self.spec: TrajectorySpec | None = None
        self.learner: Learner | None = None  # what it batches for: its version, experience and values needed
        self.freshness = Freshness()  # the records taken: checkpointed with the learner
        self.rejected = CountedWarnings("experience records skipped")
        self.lag = LagMeter()
        self.chunks_consumed = 0
        self.chunks_rejected_stale = 0
        self.ahead = 0  # the highest version of a chunk acted above the trainer's (it lost newer weights)
        # run counters not yet added in Redis: stale chunks, and accepted chunks by policy lag (chunks_lag_N)
        self.unreported: Counter[str] = Counter()
        self._pending: list[Trajectory] = []
        self._steps = 0  # env steps in _pending
        # of the last chunk seen: the first take is of one chunk
        self._chunk_steps = trainer.samples_per_update

    def start(self, spec: TrajectorySpec, learner: Learner) -> None:
        self.spec, self.learner = spec, learner

    def entries_wanted(self) -> int:
        """How many stream entries to take for the batch in progress, judged by the size of the last chunk."""
        return math.ceil((self.samples_per_update - self._steps) / self._chunk_steps)

    def add(self, entries: list[bytes | RecordError]) -> tuple[list[Trajectory], int] | None:
        """Take ``entries``; the batch and its env steps once they reach ``samples_per_update``, else None."""
        accepted = [c for c in map(self.accept, entries) if c is not None]
        self._pending.extend(accepted)
        self._steps += sum(c.num_steps for c in accepted)
        self._chunk_steps = accepted[-1].num_steps if accepted else self._chunk_steps
        self.chunks_consumed += len(entries)
        if self._steps < self.samples_per_update:
            return None
        batch, steps, self._pending, self._steps = self._pending, self._steps, [], 0
        return batch, steps

    def accept(self, entry: bytes | RecordError) -> Trajectory | None:
        """The trajectory of a stream entry if it may be learned from; None (counted) for a bad or stale one."""
        assert self.spec is not None and self.learner is not None
        version = self.learner.core.version
        try:
            if isinstance(entry, RecordError):
                raise entry
            trajectory = decode_trajectory(entry, self.spec)
            if trajectory.policy_version > version:
                self.ahead = max(self.ahead, trajectory.policy_version)
                raise RecordError(
                    "impossible_version",
                    f"a chunk of policy version {trajectory.policy_version}, above the trainer's {version}",
                )
            self.freshness.take(
                trajectory.rollout_incarnation, trajectory.sequence, trajectory.policy_version
            )
            if self.learner.needs_values and not trajectory.has_values:
                raise RecordError("missing_field", f"a chunk without the values {self.algorithm} learns from")
        except RecordError as error:
            self.rejected.add(error.reason, str(error))
            return None
        lag = version - trajectory.policy_version
        if self.learner.experience == "trajectories" and lag > self.max_policy_lag:
            self.chunks_rejected_stale += 1
            self.unreported["chunks_rejected_stale"] += 1
            return None
        self.lag.record(lag)
        self.unreported[f"chunks_lag_{lag}"] += 1
        return trajectory

    def figures(self) -> dict[str, Any]:
        """Its fields of the trainer's status: chunks consumed and rejected, the policy lag of those taken."""
        lag_min, lag_mean, lag_max = self.lag.summary()
        return {
            "chunks_consumed": self.chunks_consumed,
            "chunks_rejected_stale": self.chunks_rejected_stale,
            "policy_lag_min": lag_min,
            "policy_lag_mean": lag_mean,
            "policy_lag_max": lag_max,
            "policy_lag_counts": self.lag.counts(),
            "records_rejected": self.rejected.totals,
        }

    def take_unreported(self) -> Counter[str]:
        """The counts since the last call, for the run's counters: stale chunks, lags, records skipped by reason."""
        counts, self.unreported = self.unreported, Counter()
        counts.update({f"records_rejected_{k}": n for k, n in self.rejected.take_unreported().items()})
        return counts
