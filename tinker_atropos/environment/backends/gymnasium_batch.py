"""Reference backend: one ``gymnasium.make`` instance per slot, stepped in a Python loop.

Works for any env ``env.id`` can name; it is also the ground truth that faster backends are tested against.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from tinker_atropos.environment.backends.base import BatchSetup
from tinker_atropos.environment.envs import env_maker, flat_box, observation_layout, supported_spaces
from tinker_atropos.protocol.steps import StepBatch


class GymnasiumBatch:
    def __init__(self, setup: BatchSetup) -> None:
        make, num_instances = env_maker(setup.env_id), setup.num_instances
        self.envs: list[gym.Env] = [make(**setup.kwargs) for _ in range(num_instances)]
        self.observation_layout = observation_layout(self.envs[0].observation_space)
        observed = (
            self.envs[0].observation_space
            if self.observation_layout is None
            else flat_box(self.observation_layout)
        )
        spaces = supported_spaces(observed, self.envs[0].action_space)
        self.observation_space, self.action_space = spaces.observation_space, spaces.action_space
        self.num_instances = num_instances
        obs_shape = self.observation_space.shape
        self._obs = np.zeros((num_instances, *obs_shape), dtype=np.float32)

    def _flat(self, obs: Any) -> np.ndarray:
        """An observation as the Box row the protocol carries (a Dict's entries flattened in key order)."""
        return obs if self.observation_layout is None else gym.spaces.flatten(self.observation_layout, obs)

    def reset(self, seed: int | None) -> np.ndarray:
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=None if seed is None else seed + i)
            self._obs[i] = self._flat(obs)
        return self._obs.copy()

    def step(self, actions: np.ndarray) -> StepBatch:
        n = self.num_instances
        rewards = np.zeros(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        finals: list[np.ndarray] = []
        final_indices: list[int] = []
        for i, env in enumerate(self.envs):
            obs, reward, term, trunc, _ = env.step(actions[i])
            rewards[i], terminated[i], truncated[i] = reward, term, trunc
            if term or trunc:
                finals.append(np.asarray(self._flat(obs), dtype=np.float32))
                final_indices.append(i)
                obs, _ = env.reset()
            self._obs[i] = self._flat(obs)
        obs_shape = self.observation_space.shape
        return StepBatch(
            observations=self._obs.copy(),
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            final_observations=np.stack(finals) if finals else np.zeros((0, *obs_shape), np.float32),
            final_indices=np.asarray(final_indices, dtype=np.int32),
        )

    def reset_instances(self, indices: np.ndarray) -> np.ndarray:
        for i in indices:
            self._obs[i] = self._flat(self.envs[i].reset()[0])
        return self._obs[indices].copy()

    def close(self) -> None:
        for env in self.envs:
            env.close()
