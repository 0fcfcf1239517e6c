"""The experience loop, the driver that learns from Redis: the experience stream in, versioned weights and checkpoints out.

It takes whole trajectories from the stream until it holds ``trainer.samples_per_update`` env steps (``batcher.py``:
each record checked, taken once, stale ones rejected, policy lag measured), has the algorithm's learner update the
core, and publishes each new version for the rollouts. An update that leaves a NaN or an infinity in the loss or the
parameters is undone (``training/guard.py``), so non-finite weights are never published;
``trainer.max_nonfinite_updates`` of them in a row stop the trainer with an error. The policy version only goes up:
on start the loop resumes from the latest checkpoint (``checkpointing.py``: the trainer's checkpointer hands it
over before ``run``, the loop applies it once the env's spaces built its learner) and never publishes a version
below the one already in Redis, nor adopts weights from Redis that do not load or are not finite.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import redis

from tinker_atropos.algorithms.base import Learner
from tinker_atropos.config import Config
from tinker_atropos.environment.client import EnvClient, EnvDescription
from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.protocol.trajectory import RecordError, TrajectorySpec
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.security import signing_key
from tinker_atropos.state.experience import ExperienceReader, add_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.trainer.batcher import Batcher
from tinker_atropos.trainer.checkpointing import ExperienceState
from tinker_atropos.trainer.figures import BusyMeter
from tinker_atropos.trainer.periodic_eval import PeriodicEvaluation
from tinker_atropos.trainer.publishing import PolicyPublisher
from tinker_atropos.trainer.tensorboard import TensorBoardLog
from tinker_atropos.trainer.updates import Updater
from tinker_atropos.training.driver import Checkpoint

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0


def describe_env(client: redis.Redis, run: str, stop: threading.Event) -> EnvDescription | None:
    """The spaces of the run's env, from the first env service of the registry that answers; None if stopped."""
    while not stop.is_set():
        try:
            records = live_services(client, run, "env")
        except redis.RedisError as error:
            log.warning("registry unreadable (%s); retrying", error)
            records = []
        for record in records:
            try:
                with EnvClient(record.address, "grpc") as env:
                    return env.describe(timeout_s=5)
            except grpc.RpcError as error:
                log.warning("cannot describe env service %s: %s", record.address, error.code())
        log.info("waiting for an environment service to register")
        stop.wait(1.0)
    return None


class ExperienceLoop:
    def __init__(
        self, config: Config, client: redis.Redis, run_dir: Path, tensorboard: TensorBoardLog | None = None
    ) -> None:
        """``tensorboard``: the trainer's log, where its episodes, charts and evaluations go (None: nowhere)."""
        self.config, self.client, self.run_name = config, client, config.run.name
        trainer = config.trainer
        self.publisher = PolicyPublisher(client, self.run_name)
        self.updater = Updater(config, run_dir / "learners")
        self.folder = (
            run_dir / "checkpoints"
        )  # its checkpoints (the trainer's Checkpointer writes them), best.pt
        self.checkpoints = ExperienceState(self.folder, self.updater.algorithm.name)
        # held over a step: ``save`` (another thread) takes its state between two
        self.lock = threading.Lock()
        self._resume: tuple[dict[str, Any], Path] | None = None  # the checkpoint handed over, until ``setup``
        self._progress = 0  # updates since it started
        self.batcher = Batcher(trainer, self.updater.algorithm.name)
        self.set_up = False  # built, resumed and published: what ``close`` keeps
        self.spec: TrajectorySpec | None = None
        self.updates = self.env_steps_trained = 0  # checkpointed (``_counters``)
        self.losses: dict[str, float] = {}
        self._unreported: Counter[str] = Counter()  # run counters not yet added in Redis
        self._last_sync = 0.0
        self.busy = BusyMeter()
        self.tensorboard = tensorboard
        self.evaluation = PeriodicEvaluation(config, client, self.tensorboard, self.folder)

    @property
    def learner(self) -> Learner | None:
        return self.updater.learner

    @property
    def version(self) -> int:
        return 0 if self.learner is None else self.learner.core.version

    def status(self) -> services_pb2.TrainerStatus:
        """Its figures (the writes into the run folder: the checkpointer's and the trainer's TensorBoard log's)."""
        return services_pb2.TrainerStatus(
            **self.batcher.figures(),
            **self.evaluation.figures(),
            policy_version=self.version,
            updates=self.updates,
            env_steps_trained=self.env_steps_trained,
            busy_fraction=self.busy.fraction(),
            losses=self.losses,
            updates_discarded_nonfinite=self.updater.guard.undone,
        )

    # -- state ---------------------------------------------------------------------------------------
    def setup(self, env: EnvDescription) -> None:
        """Build the learner for the env's spaces, resume from the checkpoint handed over (``restore``), publish."""
        with self.lock:
            self._setup(env)

    def _setup(self, env: EnvDescription) -> None:
        self.spec = TrajectorySpec.from_spaces(env.observation_space, env.action_space)
        learner = self.updater.build(env)
        self.batcher.start(self.spec, learner)
        state, source = self._resume or (None, None)
        state, self._resume = self.checkpoints.restore(learner, state, source), None
        if state is not None:
            # format 4 on; before, the stream held records of schema 2, refused anyway
            if "freshness" in state:
                self.batcher.freshness = Freshness(state["freshness"])
            counters = state["counters"]
            self.updates, self.env_steps_trained = counters["updates"], counters["env_steps_trained"]
        resumed = self.version
        self.publisher.adopt_newer(learner)
        if self.version > resumed:  # what it learned past its checkpoint is in these weights, not freshness's
            self.batcher.freshness.restarted_at(self.version)
        self.publish()
        self.updater.start_replicas()
        self.set_up = True

    # -- what the trainer's Checkpointer asks (driver.py) ------------------------------------------------
    def save(self) -> Checkpoint | None:
        """Its state in format 4 (``ExperienceState``), the replay buffer's new transitions journaled first; None
        before ``setup``."""
        with self.lock:
            if self.learner is None or not self.set_up:
                return None
            return self.checkpoints.checkpoint(self.learner, self._counters(), self.batcher.freshness)

    def restore(self, state: dict[str, Any], source: Path) -> None:
        """Kept until ``setup`` built the learner it goes into."""
        self._resume = state, source

    def progress(self) -> int:
        return self._progress

    def _counters(self) -> dict[str, int]:
        return {"updates": self.updates, "env_steps_trained": self.env_steps_trained}

    def publish(self) -> None:
        assert self.learner is not None
        self.publisher.publish(self.learner.core)

    def run(self, stop: threading.Event) -> None:
        """Learn from the run's experience until ``stop``, once an env service has told the env's spaces."""
        env = describe_env(self.client, self.run_name, stop)
        if env is not None:
            self.setup(env)
            self.train(stop)

    def close(self) -> None:
        """After learning and its last checkpoint: an evaluation in flight may finish (seconds); TensorBoard gets the
        episodes that ended since its last look (the rollouts stopped first: those of every chunk they wrote; the
        trainer closes the log after its last driver); the last counts."""
        self.updater.close()
        if not self.set_up:  # stopped before an env service answered, or setup failed: nothing to keep
            return
        self.evaluation.join(timeout_s=10.0)
        if self.tensorboard is not None:
            with contextlib.suppress(redis.RedisError):  # Redis away: only these last episodes are missing
                self._look()
        with contextlib.suppress(redis.RedisError):  # Redis away: only these last counts are lost
            self.report_counters()

    def report_counters(self) -> None:
        """Add this trainer's new counts to the run's counters; also called at shutdown, so the run's final
        figures count every chunk."""
        self._unreported.update(self.batcher.take_unreported())
        if self.tensorboard is not None:
            self._unreported["tensorboard_writes_failed"] += self.tensorboard.writes.take_unreported()
        add_stats(self.client, self.run_name, **self._unreported)
        self._unreported.clear()

    def sync_redis(self) -> None:
        """Report counters, and publish again if Redis lost the weights (restarted without persistence)
        or missed the last publication: rollouts must always find the current version."""
        now = time.monotonic()
        if now - self._last_sync < SYNC_INTERVAL_S:
            return
        self.report_counters()
        self._look()
        assert self.learner is not None
        if self.publisher.keep_current(self.learner, self.batcher.ahead):
            self.batcher.ahead = 0
        self._last_sync = now

    def _look(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.look(
                self.version, self.updates, self.busy.fraction(), self.batcher.lag.summary()[1], self.losses
            )

    # -- learning ------------------------------------------------------------------------------------
    def train(self, stop: threading.Event) -> None:
        assert self.learner is not None
        reader = ExperienceReader(self.client, self.run_name, signing_key("experience"))
        while not stop.is_set():
            try:
                with self.lock:
                    self.sync_redis()
                raw = reader.take(count=self.batcher.entries_wanted(), block_ms=500)
            except redis.RedisError as error:
                log.warning("Redis unreachable (%s); retrying", error)
                stop.wait(1.0)
                continue
            with self.lock:
                self.step(raw)

    def step(self, raw: list[bytes | RecordError]) -> None:
        """Entries read from the stream into the batcher; once it holds a batch, one update, published."""
        assert self.learner is not None
        batch = self.batcher.add(raw)
        if batch is None:
            return
        trajectories, batch_steps = batch
        start = time.monotonic()
        losses = self.updater.learn(trajectories)
        self.busy.record(start, time.monotonic())
        if losses is None:
            return
        self.losses = losses
        self.updates += 1
        self._progress += 1
        self.env_steps_trained += batch_steps
        try:
            self.publish()
        except redis.RedisError as error:
            log.warning("cannot publish version %d (%s); will retry", self.version, error)
        self.evaluation.after_update(self.updates, self.learner.core)
