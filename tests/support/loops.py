"""The experience loop in the test's process as the trainer service runs it: its checkpointer resumes it, then the
env's spaces set it up; and the version-0 policy it would publish first (``initial_policy``), for benchmarks and
tests that start rollouts without a trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
import torch

from tests.support.envs import pendulum_env
from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.config import Config
from tinker_atropos.environment.check import check_env
from tinker_atropos.trainer.checkpointing import Checkpointer
from tinker_atropos.trainer.experience_loop import ExperienceLoop


def started_loop(config: Config, client: redis.Redis, run_dir: Path) -> tuple[ExperienceLoop, Checkpointer]:
    """An experience loop on Pendulum, resumed from ``run_dir``'s latest checkpoint if any, and its checkpointer
    (``save(force=True)`` writes one)."""
    loop = ExperienceLoop(config, client, run_dir)
    checkpointer = Checkpointer(loop, loop.folder, config.trainer.checkpoint, None)
    checkpointer.resume()
    loop.setup(pendulum_env())
    return loop, checkpointer


def initial_policy(config: Config) -> tuple[bytes, dict[str, Any]]:
    """Version-0 weights and spec, built as the trainer builds them (spaces from a local instance)."""
    spaces = check_env(config.env)
    algorithm = algorithms.algorithm(config.trainer.algorithm)
    setup = LearnerSetup(
        spaces.observation_space,
        spaces.action_space,
        config.trainer,
        config.trainer.hyperparameters,
        torch.device("cpu"),
        config.run.seed,
    )
    learner = algorithm.build(setup)
    return learner.core.weights(), learner.core.spec
