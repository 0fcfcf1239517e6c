"""The interface every simulation backend of the environment service implements.

A backend steps a batch of instances of one env together and resets finished episodes itself (autoreset).
The service only validates requests, encodes tensors and keeps episode statistics, so a faster backend
(threads, C-level batching) can replace the gymnasium one without touching the protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from tinker_atropos.protocol.steps import StepBatch


class EnvBatch(Protocol):
    """N instances of one Gymnasium env id, stepped as a batch."""

    observation_space: gym.Space  # a Box; for a Dict env, its flat Box (``observation_layout`` is the Dict)
    action_space: gym.Space
    observation_layout: gym.spaces.Dict | None
    num_instances: int

    def reset(self, seed: int | None) -> np.ndarray:
        """Reset every instance; instance i is seeded with ``seed + i``. Returns [N, *obs_shape] float32."""
        ...

    def step(self, actions: np.ndarray) -> StepBatch:
        """Step every instance with its row of ``actions`` (already validated and clipped). The arrays are
        the caller's: the batch does not write into them afterwards."""
        ...

    def reset_instances(self, indices: np.ndarray) -> np.ndarray:
        """Start a new episode on the given instances (unseeded: they go on drawing from their own RNGs);
        returns their first observations, [len(indices), *obs_shape] float32."""
        ...

    def close(self) -> None: ...


def make_env_batch(
    backend: str, env_id: str, kwargs: dict[str, Any], num_instances: int, threads: int = 2
) -> EnvBatch:
    """Build the backend named in the config (``env.backend``); ``threads`` is for backends that use them."""
    if backend == "gymnasium":
        from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch

        return GymnasiumBatch(env_id, kwargs, num_instances)
    if backend == "mujoco":
        from tinker_atropos.environment.backends.mujoco_batch import MujocoBatch

        return MujocoBatch(env_id, kwargs, num_instances, num_threads=threads)
    raise ValueError(f"unknown env backend {backend!r}; allowed: 'gymnasium', 'mujoco'")
