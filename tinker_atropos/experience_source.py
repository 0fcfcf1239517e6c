"""Experience for a researcher's own training loop: whole trajectories from a run's experience stream, acted by
the policy the rollouts hold (the one a Tinker client last saved with ``save_weights_for_sampler``).

The env and rollout services collect; the loop learns through the Tinker API::

    from tinker_atropos.experience_source import ExperienceSource

    source = ExperienceSource("redis://127.0.0.1:6379/0", run="pendulum")
    batch = source.batch(steps=2048, min_policy_version=version - 1)   # list[Trajectory], [T, N, …] arrays

Records that are not trajectories of this run's spaces, or that this source has taken before (a copy written back
into the stream), are skipped and counted by reason (``source.skipped``), and so are trajectories acted by a
policy older than ``min_policy_version`` (``source.stale``); nothing is retried.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import redis

from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.protocol.trajectory import RecordError, Trajectory, TrajectorySpec, decode_trajectory
from tinker_atropos.security import signing_key
from tinker_atropos.state.connection import connect
from tinker_atropos.state.experience import ExperienceReader, recent_episodes
from tinker_atropos.state.weights import fetch_weights, published_version

__all__ = ["ExperienceSource", "Trajectory"]


def spec_of_policy(spec: dict) -> TrajectorySpec:
    """What a trajectory acted by the published policy must fit, read off its spec."""
    action = spec["action"]
    if action["kind"] == "discrete":
        start = int(action.get("start", 0))
        return TrajectorySpec(tuple(spec["obs_shape"]), (), (start, start + int(action["n"]) - 1))
    return TrajectorySpec(tuple(spec["obs_shape"]), tuple(action["shape"]), None)


class ExperienceSource:
    def __init__(self, redis_url: str | redis.Redis, run: str) -> None:
        self.client = connect(redis_url) if isinstance(redis_url, str) else redis_url
        self.run = run
        self._key = signing_key("weights")
        self._reader = ExperienceReader(self.client, run, signing_key("experience"))
        self.skipped: Counter[str] = Counter()  # records not decoded or taken before, by reason
        self._freshness = Freshness()
        self.stale = 0  # trajectories dropped for a policy older than asked

    def policy_version(self) -> int | None:
        """The version of the policy the rollouts act with now (None before any was published)."""
        return published_version(self.client, self.run)

    def batch(self, steps: int, min_policy_version: int = 0, timeout_s: float = 120.0) -> list[Trajectory]:
        """Whole trajectories, oldest first, until they hold at least ``steps`` env steps; each removed from the
        stream. TimeoutError if the stream does not deliver that much in ``timeout_s``."""
        weights = fetch_weights(self.client, self.run, self._key)
        if weights is None:
            raise RuntimeError(
                f"run {self.run!r} has no published policy yet: save_weights_for_sampler first"
            )
        spec = spec_of_policy(weights.spec)
        batch: list[Trajectory] = []
        have, deadline = 0, time.monotonic() + timeout_s
        chunk_steps = steps  # of the last trajectory seen: take no more records than the batch needs
        while have < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{have} of {steps} env steps arrived in {timeout_s:.0f} s: are the env and "
                    "rollout services running?"
                )
            for record in self._reader.take(count=math.ceil((steps - have) / chunk_steps), block_ms=500):
                try:
                    if isinstance(record, RecordError):
                        raise record
                    trajectory = decode_trajectory(record, spec)
                    self._freshness.take(
                        trajectory.rollout_incarnation, trajectory.sequence, trajectory.policy_version
                    )
                except RecordError as error:
                    self.skipped[error.reason] += 1
                    continue
                chunk_steps = trajectory.num_steps
                if trajectory.policy_version < min_policy_version:
                    self.stale += 1
                    continue
                batch.append(trajectory)
                have += trajectory.num_steps
        return batch

    def recent_returns(self, n: int = 32) -> list[float]:
        """Returns of the latest finished episodes, newest first."""
        return [episode["return"] for episode in recent_episodes(self.client, self.run, n)]
