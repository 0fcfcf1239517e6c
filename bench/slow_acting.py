"""``bench.slow_acting:SlowActingMLP``: a policy whose acting takes a fixed time per batch, for the rollout-scaling
curve (``bench.delay`` is its env-side twin: a fixed latency per batch step of the env)."""

from __future__ import annotations

import os
import threading
import time

import torch

from tinker_atropos.models.mlp import ActorCritic

DELAY_VARIABLE = "TA_BENCH_INFERENCE_DELAY_S"
# as a config names it (trainer.model.network); rollouts import it
NETWORK = "bench.slow_acting:SlowActingMLP"
_device = threading.Lock()  # one inference at a time in a process, as on one device


class SlowActingMLP(ActorCritic):
    """The built-in MLP, whose every batch holds the process's one inference device for a fixed time
    (``TA_BENCH_INFERENCE_DELAY_S`` seconds, 10 ms by default): a rollout whose acting is its bottleneck, as a big
    policy's is on a CPU core or a GPU, without taking the CPU that the benchmark's other processes need. A rollout
    process then acts at most 1 / delay batches per second however many sessions it holds, so more rollouts are
    the only way to more steps: what the rollout-scaling curve measures."""

    def normalize_obs(self, obs: torch.Tensor) -> torch.Tensor:  # once per batch acted, first thing
        with _device:
            time.sleep(float(os.environ.get(DELAY_VARIABLE, "0.01")))
        return super().normalize_obs(obs)
