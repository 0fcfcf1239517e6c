"""``bench.delay:DelayedEnv``: any Gymnasium env plus a fixed latency per batch step, for scaling benchmarks.

It stands for a simulator on another node: one round trip of ``delay_s`` steps a whole batch there, so the
latency is paid once per batch step of a session, not once per instance (a per-instance sleep would multiply
by the instances of the batch and stand for one remote call per instance, which no real system does). The
instances of a batch are stepped in lockstep by one thread (``GymnasiumBatch`` in an env service session), so
the first of them to reach step k pays the latency and the others of that thread, at the same step, do not.
While one session waits the CPU is free, which is what lets more env services add throughput.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import gymnasium as gym

ENV_ID = "bench.delay:DelayedEnv"  # as a config names it (env.id); env services import this module

_paid = threading.local()  # .step: the latest batch step whose latency this thread has paid


class DelayedEnv(gym.Wrapper):
    """``env_id`` made with ``env_kwargs``; each batch step of the calling thread sleeps ``delay_s`` once."""

    def __init__(self, env_id: str, delay_s: float, env_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(gym.make(env_id, **(env_kwargs or {})))
        self.delay_s = delay_s
        self._steps = 0
        _paid.step = 0  # a batch is built in the thread that steps it: its instances start from step 0

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps > getattr(_paid, "step", 0):
            _paid.step = self._steps
            time.sleep(self.delay_s)
        return self.env.step(action)
