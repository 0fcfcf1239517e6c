"""Experience records as a rollout writes them, and the malformed ones a careless or hostile writer might."""

from __future__ import annotations

import numpy as np

from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.rollout.trajectory_builder import TrajectoryBuilder


def serialized_chunk(
    instances: int,
    seed: int,
    version: int = 0,
    length: int = 8,
    obs_dim: int = 3,
    reward_fill: float | None = None,
    observation_fill: float | None = None,
) -> bytes:
    """A Pendulum-shaped record of ``length`` steps of ``instances`` instances, acted by ``version``; random
    rewards and observations unless a fill value is given."""
    rng = np.random.default_rng(seed)
    builder = TrajectoryBuilder(length, instances, (obs_dim,), (1,), np.float32)
    zeros = np.zeros(instances, np.float32)
    rewards = rng.standard_normal(instances) if reward_fill is None else np.full(instances, reward_fill)
    never = np.zeros(instances, bool)
    step = StepBatch(zeros, rewards.astype(np.float32), never, never, zeros[:0], np.zeros(0, np.int32))
    for _ in range(length):
        obs = rng.standard_normal((instances, obs_dim)).astype(np.float32)
        if observation_fill is not None:
            obs.fill(observation_fill)
        builder.add(obs, rng.standard_normal((instances, 1)).astype(np.float32), zeros, zeros, step)
    return builder.finish(
        np.zeros((instances, obs_dim), np.float32), zeros, version, "rollout", "env", "session"
    )
