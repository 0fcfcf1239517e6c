"""The trainer's learning to saturation, one learner against several (``trainer.learners``): the capacity
benchmark's learning phase.

Each point runs the trainer's own update, the APPO learner of ``configs/humanoid-16core.yaml`` (16,384 Humanoid
samples an update, 4 epochs of 4 minibatches, 64x64) or the same with a 256x256 network, on the same batch of
Humanoid-sized chunks for ``seconds``, flat out, with ``learners`` learner processes of ``threads`` threads each
(rank 0 here, its replicas started as a run starts them). Reported: env steps learned per second, the update's
time, and the part of it rank 0 spends in the collectives (each step's gradient all-reduce, waiting for the
slowest learner included) and dealing the batch out. Steps learned per second is the trainer's ceiling in a run:
a trainer fed faster than that drops or pauses the rest.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from tests.support.records import HUMANOID_ACT as ACT
from tests.support.records import HUMANOID_OBS as OBS
from tests.support.records import humanoid_chunks
from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.config import TrainerSection
from tinker_atropos.trainer.learner_replicas import Replicas
from tinker_atropos.training.data_parallel import Group

# name -> hidden sizes, samples an update, epochs, minibatches
SHAPES: dict[str, tuple[list[int], int, int, int]] = {
    "humanoid-16core": ([64, 64], 16384, 4, 4),
    "wide-256": ([256, 256], 16384, 4, 4),
}


class _Timed:
    """Seconds spent in a method of a class, while installed (rank 0's side only: the replicas are processes)."""

    def __init__(self, owner: type, name: str) -> None:
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.original = getattr(owner, name)

    def __enter__(self) -> _Timed:
        original = self.original

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *_: object) -> None:
        setattr(self.owner, self.name, self.original)


def learning_point(shape: str, learners: int, threads: int, seconds: float) -> dict[str, Any]:
    """``learners`` learners of ``threads`` threads each, updating flat out for ``seconds`` (after one warm-up)."""
    hidden, samples, epochs, minibatches = SHAPES[shape]
    trainer = TrainerSection.model_validate(
        {
            "algorithm": "appo",
            "samples_per_update": samples,
            "learners": learners,
            "torch_threads": threads,
            "model": {"hidden_sizes": hidden},
            "appo": {"update_epochs": epochs, "num_minibatches": minibatches},
        }
    )
    spaces = gym.spaces.Box(-np.inf, np.inf, (OBS,)), gym.spaces.Box(-0.4, 0.4, (ACT,))
    setup = LearnerSetup(*spaces, trainer, trainer.hyperparameters, torch.device("cpu"), seed=7)
    chunks = humanoid_chunks(samples // 1024, seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    learner = algorithms.algorithm("appo").build(setup)
    folder = tempfile.TemporaryDirectory()
    replicas = Replicas.beside(learner, setup, Path(folder.name))
    try:

        def update() -> None:
            learner.learn(chunks if replicas is None else replicas.learn(chunks))

        update()
        with _Timed(Group, "reduce_step") as reducing, _Timed(Replicas, "learn") as dealing:
            start, updates = time.perf_counter(), 0
            while time.perf_counter() - start < seconds or updates == 0:
                update()
                updates += 1
            elapsed = time.perf_counter() - start
    finally:
        if replicas is not None:
            replicas.close()
        folder.cleanup()
        torch.set_num_threads(before)
    return {
        "shape": shape,
        "learners": learners,
        "threads": threads,
        "env_steps_s": updates * samples / elapsed,
        "update_s": elapsed / updates,
        "collectives_share": reducing.seconds / elapsed,
        "dealing_share": dealing.seconds / elapsed,
        "allreduce_ms_per_step": 1000 * reducing.seconds / (updates * epochs * minibatches),
    }


def learning_points(
    shapes: tuple[str, ...], counts: tuple[tuple[int, int], ...], seconds: float
) -> list[dict]:
    """Every (learners, threads) of ``counts`` on every shape, each point's speed-up over the first of its shape."""
    points = []
    for shape in shapes:
        first = None
        for learners, threads in counts:
            point = learning_point(shape, learners, threads, seconds)
            first = first or point
            points.append(point | {"x_first": point["env_steps_s"] / first["env_steps_s"]})
    return points
