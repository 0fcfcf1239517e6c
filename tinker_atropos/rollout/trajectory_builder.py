"""Where a trajectory chunk is built: the steps of one env session accumulate in preallocated arrays until the
chunk is full, then leave as one ``Trajectory`` record (``protocol/trajectory.py``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.trajectory import Trajectory, encode_trajectory
from tinker_atropos.protocol.v1 import environment_pb2


class TrajectoryBuilder:
    """Fixed-length [T, N, …] buffers for one session; ``reset`` drops a partial chunk. ``with_values``: the
    acting policy has a critic, whose values travel with the chunk."""

    def __init__(
        self,
        length: int,
        num_instances: int,
        obs_shape: Sequence[int],
        action_shape: Sequence[int],
        action_dtype: type[np.generic],
        with_values: bool = True,
    ) -> None:
        t, n = length, num_instances
        self.length = length
        self.observations = np.zeros((t, n, *obs_shape), np.float32)
        self.actions = np.zeros((t, n, *action_shape), action_dtype)
        self.log_probs = np.zeros((t, n), np.float32)
        self.rewards = np.zeros((t, n), np.float32)
        self.terminated = np.zeros((t, n), bool)
        self.truncated = np.zeros((t, n), bool)
        self.values = np.zeros((t, n), np.float32) if with_values else None
        self.truncation_values = np.zeros((t, n), np.float32) if with_values else None
        self.obs_shape = tuple(obs_shape)
        self.truncated_observations: list[np.ndarray] = []  # per step, the final observations it truncated
        self.episodes: list[environment_pb2.EpisodeEnd] = []
        self.steps = 0

    @property
    def full(self) -> bool:
        return self.steps == self.length

    def reset(self) -> None:
        if self.truncation_values is not None:
            self.truncation_values.fill(0.0)
        self.truncated_observations = []
        self.episodes = []
        self.steps = 0

    def add(
        self,
        observations: np.ndarray,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray | None,
        step: StepBatch,
        truncation_values: np.ndarray | None = None,
    ) -> None:
        """Record the step that acted on ``observations`` and the env's answer to it; ``truncation_values``
        None means zeros (no episode was cut by the time limit)."""
        t = self.steps
        self.observations[t] = observations
        self.actions[t] = actions
        self.log_probs[t] = log_probs
        self.rewards[t] = step.rewards
        self.terminated[t] = step.terminated
        self.truncated[t] = step.truncated
        if self.values is not None:
            self.values[t] = values
            if truncation_values is not None:  # else the zeros ``reset`` left
                self.truncation_values[t] = truncation_values
        if step.final_indices.size:
            self.truncated_observations.append(step.truncated_finals()[1])
        self.episodes.extend(step.episodes)
        self.steps += 1

    def finish(
        self,
        bootstrap_observations: np.ndarray,
        bootstrap_values: np.ndarray | None,
        policy_version: int,
        rollout_incarnation: str,
        sequence: int,
        env_incarnation: str,
        session_id: str,
    ) -> bytes:
        """The full chunk as an experience record; starts the next one."""
        trajectory = Trajectory(
            policy_version=policy_version,
            observations=self.observations,
            actions=self.actions,
            log_probs=self.log_probs,
            rewards=self.rewards,
            terminated=self.terminated,
            truncated=self.truncated,
            bootstrap_observations=bootstrap_observations,
            truncated_observations=np.concatenate(
                [np.empty((0, *self.obs_shape), np.float32), *self.truncated_observations]
            ),
            values=self.values,
            truncation_values=self.truncation_values,
            bootstrap_values=bootstrap_values if self.values is not None else None,
            env_incarnation=env_incarnation,
            rollout_incarnation=rollout_incarnation,
            sequence=sequence,
            session_id=session_id,
            episodes=self.episodes,
            created_at=time.time(),
        )
        record = encode_trajectory(trajectory)
        self.reset()
        return record
