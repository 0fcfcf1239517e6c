"""``RemoteVectorEnv``: running env services as one Gymnasium ``VectorEnv``, for code that was not written for
tinker-atropos (a CleanRL loop, Gymnasium's vector wrappers, Stable-Baselines3 through ``environment.sb3``).

It holds one session per env service and steps them all at once (actions sent to every service before any answer
is read), over the local fast path or gRPC like the rollout. The env services reset an ended episode within the
same step, so the autoreset mode is ``SAME_STEP``: ``infos["final_obs"]`` holds the last observation of each ended
episode, and ``infos["episode"]`` its return and length as the env service counted them (the statistics
``gymnasium.wrappers.vector.RecordEpisodeStatistics`` would add; ``stats_key=None`` leaves them out so that
wrapper can be used instead).

A lost env service raises ``EnvServiceLost`` within seconds (gRPC keepalive; the local path sees the socket
close, and gives a stopped service ``answer_timeout_s``); ``reset()`` reconnects, finding the run's env services
in the registry again when built from a run name.

Its parts: the sessions on the env services (``service_sessions.py``) and the vector step made of their answers
(``same_step.py``); here, Gymnasium's API over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from tinker_atropos.config import Transport
from tinker_atropos.environment.same_step import SameStep
from tinker_atropos.environment.service_sessions import EnvServiceLost, ServiceSessions

__all__ = ["EnvServiceLost", "RemoteVectorEnv"]


class RemoteVectorEnv(gym.vector.VectorEnv):
    """Every instance of the env services at ``addresses`` (or of run ``run``'s, found in Redis at
    ``redis_url``), ``instances_per_service`` from each (0: all free ones), as one vector env."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        run: str | None = None,
        redis_url: str = "redis://127.0.0.1:6379/0",
        instances_per_service: int = 0,
        transport: Transport = "auto",
        stats_key: str | None = "episode",
        seed: int | None = None,
        answer_timeout_s: float = 30.0,
    ) -> None:
        if bool(addresses) == (run is not None):
            raise ValueError("give either the env services' addresses or the run whose registry lists them")
        self.stats_key = stats_key
        self._services = ServiceSessions(
            addresses, run, redis_url, instances_per_service, transport, answer_timeout_s
        )
        self._seeds = np.random.default_rng(seed)  # the seeds of resets without one
        self.description = self._services.connect()
        self.num_envs = len(self._services.open(self._next_seed(seed)))
        layout = self.description.observation_layout
        self.single_observation_space = layout if layout is not None else self.description.observation_space
        self.single_action_space = self.description.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._steps = SameStep(self.num_envs, layout)

    def _next_seed(self, seed: int | None) -> int:
        if seed is not None:
            self._seeds = np.random.default_rng(seed)
            return seed
        return int(self._seeds.integers(2**31 - 1 - 2**16))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """New sessions, instance i reset with ``seed + i`` (a seed drawn from the last one given, if none)."""
        super().reset(seed=seed)
        observations = self._services.reopen(self._next_seed(seed))
        if len(observations) != self.num_envs:
            self._services.close_sessions()
            raise EnvServiceLost(
                f"the env services now offer {len(observations)} instances, not the {self.num_envs} "
                "this vector env was made with"
            )
        self._steps.restart()
        return self._steps.observation(observations), {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if not self._services.sessions:
            raise EnvServiceLost("the sessions are closed: call reset() to open new ones")
        actions = np.asarray(actions, dtype=self.description.action_dtype)
        if actions.shape != self.action_space.shape:
            raise ValueError(f"actions must have shape {self.action_space.shape}, got {actions.shape}")
        batches = self._services.step(actions)
        return self._steps.merge(batches, self._services.bounds, self.stats_key)

    def close_extras(self, **kwargs: Any) -> None:
        """Free the instances: every session ends, every channel closes."""
        self._services.close()
