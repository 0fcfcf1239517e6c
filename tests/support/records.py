"""Experience as the tests make it: trajectories for a learner or a replay buffer, the records a rollout writes, and
the malformed ones a careless or hostile writer might."""

from __future__ import annotations

import itertools

import numpy as np

from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.rollout.trajectory_builder import TrajectoryBuilder

OBS, ACT = 3, 2  # the observation and action sizes of a trajectory, unless given
SEQUENCES = itertools.count(1)  # the writer "rollout" numbers every chunk the tests make apart


def trajectory_chunk(
    rng: np.random.Generator | int,
    t: int = 5,
    n: int = 2,
    *,
    terminated: np.ndarray | float = 0.0,
    truncated: np.ndarray | float = 0.0,
    first_obs: np.ndarray | None = None,
    version: int = 0,
    obs_dim: int = OBS,
    act_dim: int = ACT,
) -> Trajectory:
    """``t`` steps of ``n`` instances with a critic's values, every number drawn from ``rng`` (a generator or its
    seed; actions within [-1, 1], a squashed policy's bounds); ``terminated`` and ``truncated`` are the masks
    (which then set ``t`` and ``n``) or each step's chance of ending so; ``first_obs`` continues the chunk whose
    bootstrap observations it was."""
    rng = np.random.default_rng(rng)
    masks = [mask for mask in (terminated, truncated) if isinstance(mask, np.ndarray)]
    t, n = masks[0].shape if masks else (t, n)
    terminated, truncated = (
        mask if isinstance(mask, np.ndarray) else rng.random((t, n)) < mask
        for mask in (terminated, truncated)
    )
    obs = rng.normal(size=(t, n, obs_dim)).astype(np.float32)
    if first_obs is not None:
        obs[0] = first_obs
    return Trajectory(
        policy_version=version,
        env_incarnation="e",
        rollout_incarnation="rollout",
        sequence=1,
        observations=obs,
        actions=rng.uniform(-1, 1, (t, n, act_dim)).astype(np.float32),
        log_probs=rng.normal(size=(t, n)).astype(np.float32),
        values=rng.normal(size=(t, n)).astype(np.float32),
        rewards=rng.normal(size=(t, n)).astype(np.float32),
        terminated=terminated,
        truncated=truncated,
        truncation_values=rng.normal(size=(t, n)).astype(np.float32),
        bootstrap_observations=rng.normal(size=(n, obs_dim)).astype(np.float32),
        truncated_observations=rng.normal(size=(int(truncated.sum()), obs_dim)).astype(np.float32),
        bootstrap_values=rng.normal(size=n).astype(np.float32),
    )


def serialized_chunk(
    instances: int,
    seed: int,
    version: int = 0,
    length: int = 8,
    obs_dim: int = 3,
    reward_fill: float | None = None,
    observation_fill: float | None = None,
    sequence: int | None = None,
) -> bytes:
    """A Pendulum-shaped record of ``length`` steps of ``instances`` instances, acted by ``version``; random
    rewards and observations unless a fill value is given; the next of ``SEQUENCES`` unless ``sequence`` is
    given."""
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
        np.zeros((instances, obs_dim), np.float32),
        zeros,
        version,
        "rollout",
        next(SEQUENCES) if sequence is None else sequence,
        "env",
        "session",
    )


# Humanoid-v5 chunks as the rollout writes them, random: what learner benchmarks feed without a simulator
HUMANOID_OBS, HUMANOID_ACT, HUMANOID_T, HUMANOID_N = 348, 17, 64, 16


def humanoid_chunks(count: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return [
        Trajectory(
            policy_version=0,
            env_incarnation="x",
            observations=rng.normal(size=(HUMANOID_T, HUMANOID_N, HUMANOID_OBS)).astype(f32),
            actions=rng.normal(scale=0.3, size=(HUMANOID_T, HUMANOID_N, HUMANOID_ACT)).astype(f32),
            log_probs=rng.normal(-15.7, 0.5, size=(HUMANOID_T, HUMANOID_N)).astype(f32),
            values=rng.normal(size=(HUMANOID_T, HUMANOID_N)).astype(f32),
            rewards=rng.normal(5, 1, size=(HUMANOID_T, HUMANOID_N)).astype(f32),
            terminated=rng.random((HUMANOID_T, HUMANOID_N)) < 0.02,
            truncated=np.zeros((HUMANOID_T, HUMANOID_N), bool),
            truncation_values=np.zeros((HUMANOID_T, HUMANOID_N), f32),
            bootstrap_observations=rng.normal(size=(HUMANOID_N, HUMANOID_OBS)).astype(f32),
            truncated_observations=np.zeros((0, HUMANOID_OBS), f32),
            bootstrap_values=rng.normal(size=HUMANOID_N).astype(f32),
        )
        for _ in range(count)
    ]
