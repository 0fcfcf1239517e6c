"""Reference backend: one ``gymnasium.make`` instance per slot, stepped in a Python loop.

Works for any env ``env.id`` can name; it is also the ground truth that faster backends are tested against.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from tinker_atropos.environment.envs import env_maker, supported_spaces
from tinker_atropos.protocol.steps import StepBatch


class GymnasiumBatch:
    def __init__(self, env_id: str, kwargs: dict[str, Any], num_instances: int) -> None:
        make = env_maker(env_id)
        self.envs: list[gym.Env] = [make(**kwargs) for _ in range(num_instances)]
        spaces = supported_spaces(self.envs[0].observation_space, self.envs[0].action_space)
        self.observation_space, self.action_space = spaces.observation_space, spaces.action_space
        self.num_instances = num_instances
        obs_shape = self.observation_space.shape
        self._obs = np.zeros((num_instances, *obs_shape), dtype=np.float32)

    def reset(self, seed: int | None) -> np.ndarray:
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=None if seed is None else seed + i)
            self._obs[i] = obs
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
                finals.append(np.asarray(obs, dtype=np.float32))
                final_indices.append(i)
                obs, _ = env.reset()
            self._obs[i] = obs
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
            self._obs[i], _ = self.envs[i].reset()
        return self._obs[indices].copy()

    def close(self) -> None:
        for env in self.envs:
            env.close()
