"""The experience loop in the test's process as the trainer service runs it: its checkpointer resumes it, then the
env's spaces set it up."""

from __future__ import annotations

from pathlib import Path

import redis

from tests.support.envs import pendulum_env
from tinker_atropos.config import Config
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
