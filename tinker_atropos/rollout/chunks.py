"""Trajectory assembly: steps of one env session accumulate in preallocated arrays until a chunk is full."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.chunks import encode_record
from tinker_atropos.protocol.v1 import environment_pb2, experience_pb2


class ChunkBuilder:
    """Fixed-length [T, N, …] buffers for one session; ``reset`` drops a partial chunk."""

    def __init__(
        self,
        length: int,
        num_instances: int,
        obs_shape: Sequence[int],
        action_shape: Sequence[int],
        action_dtype: np.dtype,
    ) -> None:
        t, n = length, num_instances
        self.length = length
        self.observations = np.zeros((t, n, *obs_shape), np.float32)
        self.actions = np.zeros((t, n, *action_shape), action_dtype)
        self.log_probs = np.zeros((t, n), np.float32)
        self.values = np.zeros((t, n), np.float32)
        self.rewards = np.zeros((t, n), np.float32)
        self.terminated = np.zeros((t, n), bool)
        self.truncated = np.zeros((t, n), bool)
        self.truncation_values = np.zeros((t, n), np.float32)
        self.episodes: list[environment_pb2.EpisodeEnd] = []
        self.steps = 0

    @property
    def full(self) -> bool:
        return self.steps == self.length

    def reset(self) -> None:
        self.truncation_values.fill(0.0)
        self.episodes = []
        self.steps = 0

    def add(
        self,
        observations: np.ndarray,
        actions: np.ndarray,
        log_probs: np.ndarray,
        values: np.ndarray,
        result: environment_pb2.StepResult,
        truncation_values: np.ndarray | None,
    ) -> None:
        """Record the step that acted on ``observations`` and the env's answer to it; ``truncation_values``
        None means zeros (no episode was cut by the time limit)."""
        t = self.steps
        self.observations[t] = observations
        self.actions[t] = actions
        self.log_probs[t] = log_probs
        self.values[t] = values
        self.rewards[t] = tensors.decode(result.rewards)
        self.terminated[t] = tensors.decode(result.terminated)
        self.truncated[t] = tensors.decode(result.truncated)
        if truncation_values is not None:  # else the zeros ``reset`` left
            self.truncation_values[t] = truncation_values
        self.episodes.extend(result.episodes)
        self.steps += 1

    def finish(
        self,
        bootstrap_observations: np.ndarray,
        bootstrap_values: np.ndarray,
        policy_version: int,
        rollout_incarnation: str,
        env_incarnation: str,
        session_id: str,
    ) -> bytes:
        """The full chunk as an experience record (``encode_record``); starts the next one."""
        chunk = experience_pb2.TrajectoryChunk(
            rollout_incarnation=rollout_incarnation,
            env_incarnation=env_incarnation,
            session_id=session_id,
            policy_version=policy_version,
            observations=tensors.encode(self.observations),
            actions=tensors.encode(self.actions),
            log_probs=tensors.encode(self.log_probs),
            values=tensors.encode(self.values),
            rewards=tensors.encode(self.rewards),
            terminated=tensors.encode(self.terminated),
            truncated=tensors.encode(self.truncated),
            truncation_values=tensors.encode(self.truncation_values),
            bootstrap_observations=tensors.encode(bootstrap_observations),
            bootstrap_values=tensors.encode(bootstrap_values),
            episodes=self.episodes,
            created_at=time.time(),
        )
        self.reset()
        return encode_record(chunk)
