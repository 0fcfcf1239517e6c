"""``RemoteSB3VecEnv``: a ``RemoteVectorEnv`` behind Stable-Baselines3's ``VecEnv`` interface, so that
``PPO("MlpPolicy", RemoteSB3VecEnv(run="pendulum"))`` learns from env services.

SB3's conventions are kept: ``dones`` is terminated or truncated, an ended episode's last observation is in
``infos[i]["terminal_observation"]`` and a time-limit cut is ``infos[i]["TimeLimit.truncated"]`` (what SB3
bootstraps from), and the env service's episode statistics are ``infos[i]["episode"]`` as SB3's ``Monitor`` writes
them, so ``rollout/ep_rew_mean`` is logged. Needs the ``sb3`` extra (stable-baselines3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from tinker_atropos.environment.vector_env import RemoteVectorEnv


class RemoteSB3VecEnv(VecEnv):
    """Takes a ``RemoteVectorEnv``, or the arguments to make one."""

    def __init__(self, *args: Any, env: RemoteVectorEnv | None = None, **kwargs: Any) -> None:
        self.env = env if env is not None else RemoteVectorEnv(*args, **kwargs)
        self._actions: np.ndarray | None = None
        super().__init__(self.env.num_envs, self.env.single_observation_space, self.env.single_action_space)

    def reset(self) -> VecEnvObs:
        """Seeded by ``seed(s)`` as SB3 does it: env i with ``s + i``, which is how the env services seed."""
        observations, _ = self.env.reset(seed=self._seeds[0])
        self._reset_seeds()
        self._reset_options()
        return observations

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        assert self._actions is not None, "step_async first"
        observations, rewards, terminated, truncated, infos = self.env.step(self._actions)
        dones = terminated | truncated
        stats, with_stats = infos.get(self.env.stats_key or "", {}), infos.get(f"_{self.env.stats_key}")
        out: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for i in np.flatnonzero(dones):
            out[i]["terminal_observation"] = infos["final_obs"][i]
            out[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            if with_stats is not None and with_stats[i]:
                out[i]["episode"] = {
                    "r": float(stats["r"][i]),
                    "l": int(stats["l"][i]),
                    "t": float(stats["t"][i]),
                }
        return observations, rewards.astype(np.float32), dones, out

    def close(self) -> None:
        self.env.close()

    # The instances live in the env services: their attributes and methods are not reachable from here.
    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The vector env's own attribute (``render_mode``, ``description``…) for each index asked."""
        return [getattr(self.env, attr_name)] * len(self._get_indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        raise AttributeError(f"cannot set {attr_name!r}: the env instances live in their env services")

    def env_method(
        self, method_name: str, *args: Any, indices: VecEnvIndices = None, **kwargs: Any
    ) -> list[Any]:
        raise AttributeError(f"cannot call {method_name!r}: the env instances live in their env services")

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None
    ) -> Sequence[bool]:
        """No client-side wrappers: the env services report episodes themselves (``infos[i]["episode"]``)."""
        return [False] * len(self._get_indices(indices))
