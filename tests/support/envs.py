"""Test envs, named in configs as ``tests.support.envs:Class`` (or by the ids this module registers).

``NaNPendulum`` is Pendulum with a simulator that blows up now and then: a NaN reward, or a NaN observation,
every so many steps of each instance. ``DictPendulum`` observes through a Dict space, which the protocol does
not carry yet. ``pendulum_env`` is what an env service of Pendulum-v1 describes itself as, for a trainer built
without one.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.pendulum import PendulumEnv

from tinker_atropos.environment.client import EnvDescription

NAN_PENDULUM_ID = "TinkerAtroposTest/NaNPendulum-v0"


class NaNPendulum(PendulumEnv):
    """Pendulum whose step ``k`` of an instance returns a NaN reward when ``k % nan_reward_every == 0`` and a
    NaN observation when ``k % nan_obs_every == 0`` (0 turns one off)."""

    def __init__(self, nan_reward_every: int = 0, nan_obs_every: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_reward_every, self.nan_obs_every = nan_reward_every, nan_obs_every
        self._steps = 0

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        self._steps += 1
        if self.nan_reward_every and self._steps % self.nan_reward_every == 0:
            reward = float("nan")
        if self.nan_obs_every and self._steps % self.nan_obs_every == 0:
            obs = np.full_like(obs, np.nan)
        return obs, reward, terminated, truncated, info


class DictPendulum(gym.ObservationWrapper):
    """Pendulum observed as ``{"state": …, "mode": 0}``: a Dict with a Discrete entry, which is not served."""

    def __init__(self) -> None:
        super().__init__(PendulumEnv())
        self.observation_space = gym.spaces.Dict(
            {"state": self.env.observation_space, "mode": gym.spaces.Discrete(2)}
        )

    def observation(self, observation: np.ndarray) -> dict[str, np.ndarray | int]:
        return {"state": observation, "mode": 0}


if NAN_PENDULUM_ID not in gym.registry:
    gym.register(NAN_PENDULUM_ID, entry_point=NaNPendulum, max_episode_steps=200)


def pendulum_env() -> EnvDescription:
    """What an env service of Pendulum-v1 describes itself as."""
    env = gym.make("Pendulum-v1")
    return EnvDescription("Pendulum-v1", env.observation_space, env.action_space, 8, 8, "e", "gymnasium", "")
