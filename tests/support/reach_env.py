"""A Dict-observation env for the tests: move a point to a goal on a plane, seeing the goal and the position as
vectors and the position as a small image. ``tinker_atropos`` serves it by ``env.id: tests.support.reach_env:Reach``."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

SIDE = 8  # pixels of the view


class Reach(gym.Env):
    def __init__(self, max_steps: int = 40) -> None:
        self.observation_space = gym.spaces.Dict(
            [
                ("goal", gym.spaces.Box(-1.0, 1.0, (2,), np.float32)),
                ("position", gym.spaces.Box(-1.0, 1.0, (2,), np.float32)),
                ("view", gym.spaces.Box(0, 255, (SIDE, SIDE, 1), np.uint8)),
            ]
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.max_steps = max_steps

    def _observation(self) -> dict[str, np.ndarray]:
        view = np.zeros((SIDE, SIDE, 1), np.uint8)
        x, y = ((self.position + 1) / 2 * (SIDE - 1)).round().astype(int)
        view[y, x, 0] = 255
        return {"goal": self.goal.copy(), "position": self.position.copy(), "view": view}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.goal = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.position = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.steps = 0
        return self._observation(), {}

    def step(self, action: np.ndarray):
        self.position = np.clip(self.position + 0.1 * np.clip(action, -1, 1), -1, 1).astype(np.float32)
        self.steps += 1
        reward = -float(np.linalg.norm(self.position - self.goal))
        return self._observation(), reward, False, self.steps >= self.max_steps, {}
