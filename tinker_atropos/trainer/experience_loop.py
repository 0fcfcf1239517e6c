"""The Redis-fed front-end of the training core: the experience stream in, versioned weights and checkpoints out.

It takes whole trajectories from the stream until it holds ``trainer.samples_per_update`` env steps, checks every
record (``decode_trajectory``: a bad one is skipped and counted by reason) and, for an on-policy learner, its
staleness (more than ``trainer.max_policy_lag`` versions old: rejected and counted; an off-policy learner's replay
takes chunks of any age), has the algorithm's learner update the core, and publishes each new version for the
rollouts. An update that leaves a NaN or an infinity in the loss or the parameters is undone (``training/guard.py``),
so non-finite weights are never published; ``trainer.max_nonfinite_updates`` of them in a row stop the trainer with
an error. The policy version only goes up: on start the loop resumes from the latest checkpoint and never publishes a
version below the one already in Redis, nor adopts weights from Redis that do not load or are not finite. No record
is learned from twice: each names its writer and its number among that writer's records, and the loop refuses
(counts) one it has taken before (``protocol/freshness.py``); what it has taken is checkpointed with the rest. A
checkpoint that the disk refuses (full, read-only) is counted and retried while learning goes on; before each one the
loop checks that the run folder is still its run's (``RunFolderOwner``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from tinker_atropos.algorithms import core as algorithms
from tinker_atropos.algorithms.core import Learner, LearnerSetup
from tinker_atropos.config import Config
from tinker_atropos.device import resolve_device
from tinker_atropos.environment.client import EnvDescription
from tinker_atropos.errors import FatalError
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.models.weights import load_weights
from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.protocol.trajectory import RecordError, Trajectory, TrajectorySpec, decode_trajectory
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.security import signing_key
from tinker_atropos.state.checkpoints import load_latest_checkpoint, save_checkpoint
from tinker_atropos.state.experience import ExperienceReader, add_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.replay_journal import ReplayJournal
from tinker_atropos.state.run_dir import FolderWrites, RunFolderOwner, oldest_failure
from tinker_atropos.state.weights import fetch_weights, publish_weights, verified_version
from tinker_atropos.trainer.evaluation import PeriodicEvaluation
from tinker_atropos.trainer.metrics import BusyMeter, LagMeter
from tinker_atropos.trainer.tensorboard import TensorBoardLog
from tinker_atropos.training.guard import NonfiniteGuard

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0
# {"format", "algorithm", "learner": Learner.state_dict(), "replay", "policy", "counters", "freshness"}; "replay" is
# None or {"added": N}, the buffer's transitions being in the journal's segments (format 2 held them in the file);
# "freshness": Freshness.state_dict(), the records taken (format 4 on)
CHECKPOINT_FORMAT = 4


class TrainingDiverged(FatalError):
    """Updates kept coming out non-finite: restarting would not help, the config or the data must change."""


class ExperienceLoop:
    def __init__(
        self, config: Config, client: redis.Redis, run_dir: Path, owner: RunFolderOwner | None = None
    ) -> None:
        self.config, self.client, self.run = config, client, config.run.name
        self.owner = owner
        self.checkpoint_writes = FolderWrites("checkpoint", "learning goes on without checkpoints")
        self.weights_key = signing_key("weights")  # what the rollouts check the published weights against
        self.checkpoint_dir = run_dir / "checkpoints"
        self.journal = ReplayJournal(self.checkpoint_dir / "replay")  # used by an off-policy learner only
        self._journaled = 0  # the replay buffer's transitions numbered below this are in the journal
        self.device = resolve_device(config.trainer.device)
        self.algorithm = algorithms.algorithm(config.trainer.algorithm)
        self.incarnation = ""
        self.learner: Learner | None = None
        self.spec: TrajectorySpec | None = None
        self.updates = 0
        self.env_steps_trained = 0
        self.chunks_consumed = 0
        self.chunks_rejected_stale = 0
        self.guard = NonfiniteGuard()  # counts the updates it undid: ``updates_discarded_nonfinite``
        self.rejected = CountedWarnings("experience records skipped")
        self.freshness = Freshness()
        self._ahead = 0  # the highest version of a chunk acted above this trainer's (it lost newer weights)
        self.losses: dict[str, float] = {}
        # run counters not yet added in Redis: stale chunks, and accepted chunks by policy lag (chunks_lag_N)
        self._unreported: Counter[str] = Counter()
        self._last_sync = 0.0
        self._last_checkpoint = time.monotonic()
        self.busy = BusyMeter()
        self.lag = LagMeter()
        self.tensorboard = (
            TensorBoardLog(
                run_dir / "tensorboard",
                client,
                self.run,
                config.trainer.wandb,
                config.model_dump(mode="json"),
            )
            if config.trainer.tensorboard
            else None
        )
        self.evaluation = PeriodicEvaluation(config.trainer.evaluation, client, self.run, config.trainer.model.network,
                                             config.run.seed, self.tensorboard, self.checkpoint_dir)  # fmt: skip

    @property
    def version(self) -> int:
        return 0 if self.learner is None else self.learner.core.version

    @version.setter
    def version(self, value: int) -> None:
        assert self.learner is not None
        self.learner.core.version = value

    def status(self) -> services_pb2.TrainerStatus:
        lag_min, lag_mean, lag_max = self.lag.summary()
        return services_pb2.TrainerStatus(
            incarnation=self.incarnation,
            policy_version=self.version,
            updates=self.updates,
            env_steps_trained=self.env_steps_trained,
            chunks_consumed=self.chunks_consumed,
            chunks_rejected_stale=self.chunks_rejected_stale,
            busy_fraction=self.busy.fraction(),
            policy_lag_min=lag_min,
            policy_lag_mean=lag_mean,
            policy_lag_max=lag_max,
            policy_lag_counts=self.lag.counts(),
            losses=self.losses,
            records_rejected=self.rejected.totals,
            updates_discarded_nonfinite=self.guard.undone,
            eval_policy_version=self.evaluation.version,
            eval_return_mean=self.evaluation.return_mean,
            eval_return_std=self.evaluation.return_std,
            eval_best_policy_version=self.evaluation.best_version,
            eval_best_return_mean=self.evaluation.best_return if self.evaluation.best_version else 0.0,
            writes_failed={w.what: w.failed for w in self._folder_writes()},
            write_failure=failing.error if (failing := oldest_failure(self._folder_writes())) else "",
            write_failing_s=failing.failing_s if failing else 0.0,
        )

    def _folder_writes(self) -> list[FolderWrites]:
        tensorboard = [self.tensorboard.writes] if self.tensorboard is not None else []
        return [self.checkpoint_writes, *tensorboard]

    # -- state ---------------------------------------------------------------------------------------
    def setup(self, env: EnvDescription) -> None:
        """Build the learner for the env's spaces, resume from the latest checkpoint, publish."""
        self.spec = TrajectorySpec.from_spaces(env.observation_space, env.action_space)
        trainer = self.config.trainer
        setup = LearnerSetup(env.observation_space, env.action_space, trainer, trainer.hyperparameters,
                             self.device, self.config.run.seed, env.observation_layout)  # fmt: skip
        try:
            self.learner = self.algorithm.build(setup)
        except ValueError as error:  # spaces the algorithm cannot act in, a user network that does not fit
            raise FatalError(f"trainer.algorithm {self.algorithm.name!r} cannot learn {self.config.env.id}: "
                             f"{error}") from None  # fmt: skip
        self._resume()
        resumed = self.version
        self.adopt_newer_weights()
        if self.version > resumed:  # what it learned past its checkpoint is in these weights, not freshness's
            self.freshness.restarted_at(self.version)
        self.publish()

    def _resume(self) -> None:
        assert self.learner is not None
        restored = load_latest_checkpoint(self.checkpoint_dir)
        if restored is None:
            self._restore_replay(None)
            return
        path, state = restored
        core = state["learner"].get("core", {}) if state.get("format", 1) >= 2 else {}
        version = core.get("version", state.get("counters", {}).get("version", 0))  # format 1: in counters
        if state.get("algorithm") != self.algorithm.name or core.get("spec") != self.learner.core.spec:
            log.warning("checkpoint %s is of another algorithm, model or layout; starting fresh above its "
                        "version %d", path, version)  # fmt: skip
            self.version = version + 1
            self._restore_replay(None)
            return
        self.learner.load_state_dict(state["learner"])
        self._restore_replay(state.get("replay"))
        if "freshness" in state:  # format 4 on; before, the stream held records of schema 2, refused anyway
            self.freshness = Freshness(state["freshness"])
        counters = state["counters"]
        self.updates, self.env_steps_trained = counters["updates"], counters["env_steps_trained"]
        log.info("resumed from %s at policy version %d", path, self.version)

    def _restore_replay(self, saved: dict[str, Any] | None) -> None:
        """Refill an off-policy learner's buffer as the checkpoint left it, and drop journal segments written
        after it (``saved`` None: the buffer starts empty, the whole journal is dropped)."""
        replay = self.learner.replay if self.learner is not None else None
        if replay is None:
            return
        if saved is not None and "rewards" in saved:  # format 2: the transitions inside the checkpoint
            columns = {name: rows.numpy() for name, rows in saved.items()}
            added = len(columns["rewards"])
            self.journal.append(0, columns)  # so that the next checkpoint's segment follows on
        else:
            added = saved["added"] if saved is not None else 0
            columns = self.journal.restore(added, replay.capacity)
        if columns is not None:
            replay.refill(columns, added)
            log.info("replay buffer restored: %d transitions", len(replay))
        replay.added = self._journaled = added

    def adopt_newer_weights(self) -> None:
        """Weights in Redis newer than the checkpoint (a trainer killed between checkpoints) are the policy
        the rollouts act with: continue from them rather than from older parameters, so a restart loses
        only the optimizer moments since the checkpoint and the version stays monotonic."""
        assert self.learner is not None
        try:
            published = fetch_weights(self.client, self.run, self.weights_key)
        except (
            ValueError
        ) as error:  # a malformed record: nothing to continue from, the next publish replaces it
            log.warning("the weights record in Redis is malformed (%s); publishing over it", error)
            return
        if published is None or published.version <= self.version:
            return
        if published.spec != self.learner.core.spec:
            log.warning("Redis holds version %d of another model; continuing above it", published.version)
            self.version = published.version + 1
            return
        try:
            load_weights(self.learner.core.model, published.blob)
        except ValueError as error:  # a NaN in them, or bytes that are not weights: never adopted
            log.warning(
                "not adopting version %d from Redis (%s); continuing above it", published.version, error
            )
            self.version = published.version + 1
            return
        log.info("continuing from the weights of version %d found in Redis", published.version)
        self.version = published.version

    def checkpoint_state(self) -> dict[str, Any]:
        assert self.learner is not None
        core = self.learner.core
        return {
            "format": CHECKPOINT_FORMAT,
            "algorithm": self.algorithm.name,
            "learner": self.learner.state_dict(),
            "replay": None if self.learner.replay is None else {"added": self.learner.replay.added},
            # the acting policy as the rollouts receive it: what `tinker-atropos eval` and `export` load
            "policy": {"spec": core.spec, "version": core.version, "weights": core.weights()},
            "counters": {"updates": self.updates, "env_steps_trained": self.env_steps_trained},
            "freshness": self.freshness.state_dict(),
        }

    def checkpoint(self) -> bool:
        """Write a checkpoint, unless the run folder now belongs to another run (RunFolderInUse). A disk that
        refuses it costs this checkpoint only: counted, said once, retried (``checkpoint_writes``). Whether it
        was written."""
        if self.owner is not None:
            self.owner.check()
        written = self.checkpoint_writes.attempt(self.checkpoint_dir, self._write_checkpoint)
        if written:
            self._last_checkpoint = time.monotonic()
        return written

    def _write_checkpoint(self) -> None:
        """The journal's new segment first, then the checkpoint that counts it: a crash between the two leaves a
        segment past the latest checkpoint, which the next resume deletes."""
        replay = self.learner.replay if self.learner is not None else None
        if replay is not None:
            columns = replay.since(self._journaled)  # fewer than asked when the journal fell a buffer behind
            self.journal.append(replay.added - len(columns["rewards"]), columns)
            self._journaled = replay.added
        path = save_checkpoint(
            self.checkpoint_dir, self.version, self.checkpoint_state(), self.config.trainer.checkpoint.keep
        )
        if replay is not None:
            self.journal.prune(replay.added, replay.capacity)
        log.info("checkpoint %s", path.name)

    def publish(self) -> None:
        """Publish the current version, or above it when another driver (a Tinker client's policy) published a
        higher one: the loop continues from the version published."""
        assert self.learner is not None
        wanted = self.version
        self.learner.core.publish_weights(
            functools.partial(publish_weights, self.client, self.run, key=self.weights_key)
        )
        if self.version != wanted:
            log.warning(
                "Redis holds a policy version at or above %d; published as version %d", wanted, self.version
            )

    def close(self) -> None:
        """Let an evaluation in flight finish (seconds); TensorBoard gets the episodes that ended since its last
        look (the rollouts stopped first: those of every chunk they wrote), then its buffer is flushed."""
        self.evaluation.join(timeout_s=10.0)
        if self.tensorboard is not None:
            with contextlib.suppress(redis.RedisError):  # Redis away: only these last episodes are missing
                self._look()
            self.tensorboard.close()

    def report_counters(self) -> None:
        """Add this trainer's new counts to the run's counters; also called at shutdown, so the run's final
        figures count every chunk."""
        self._unreported.update(
            {f"records_rejected_{k}": n for k, n in self.rejected.take_unreported().items()}
        )
        self._unreported["checkpoints_failed"] += self.checkpoint_writes.take_unreported()
        if self.tensorboard is not None:
            self._unreported["tensorboard_writes_failed"] += self.tensorboard.writes.take_unreported()
        add_stats(self.client, self.run, **self._unreported)
        self._unreported.clear()

    def sync_redis(self) -> None:
        """Report counters, and publish again if Redis lost the weights (restarted without persistence)
        or missed the last publication: rollouts must always find the current version."""
        now = time.monotonic()
        if now - self._last_sync < SYNC_INTERVAL_S:
            return
        self.report_counters()
        self._look()
        try:
            published = verified_version(self.client, self.run, self.weights_key)
        except ValueError as error:  # a malformed record, or one this trainer did not sign: replace it
            log.warning("the weights in Redis are not this run's (%s); publishing version %d over them",
                        error, self.version)  # fmt: skip
            published = None
        if self._ahead > self.version:
            self.continue_above_rollouts()
        if published is None or published < self.version:
            log.info("Redis lacks policy version %d; publishing it again", self.version)
            self.publish()
        self._last_sync = now

    def _look(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.look(
                self.version, self.updates, self.busy.fraction(), self.lag.summary()[1], self.losses
            )

    def continue_above_rollouts(self) -> None:
        """Rollouts refuse weights older than those they act with. Chunks acted by a version above this
        trainer's, which a live rollout reports holding, mean that it resumed from a checkpoint while Redis had
        lost the newer weights: it continues above that version, so that the rollouts take its next one. (The
        version of a chunk alone is not enough: a holder of the token may write any.)"""
        try:
            rollouts = live_services(self.client, self.run, "rollout")
            held = max((int(r.figures.get("policy_version") or 0) for r in rollouts), default=0)
        except redis.RedisError:
            return  # the next sync tries again
        except (ValueError, TypeError):  # a registry entry written by something else
            held = 0
        ahead, self._ahead = min(self._ahead, held), 0
        if ahead > self.version:
            log.warning("rollouts act with policy version %d, above this trainer's %d (its newer weights were "
                        "lost with Redis's data); continuing at version %d", ahead, self.version, ahead + 1)  # fmt: skip
            self.version = ahead + 1

    # -- learning ------------------------------------------------------------------------------------
    def accept(self, entry: bytes | RecordError) -> Trajectory | None:
        """The trajectory of a stream entry if it may be learned from; None (counted) for a bad or stale one."""
        assert self.spec is not None and self.learner is not None
        try:
            if isinstance(entry, RecordError):
                raise entry
            trajectory = decode_trajectory(entry, self.spec)
            if trajectory.policy_version > self.version:
                self._ahead = max(self._ahead, trajectory.policy_version)
                raise RecordError(
                    "impossible_version",
                    f"a chunk of policy version {trajectory.policy_version}, above the trainer's {self.version}",
                )
            self.freshness.take(
                trajectory.rollout_incarnation, trajectory.sequence, trajectory.policy_version
            )
            if self.learner.needs_values and not trajectory.has_values:
                raise RecordError(
                    "missing_field", f"a chunk without the values {self.algorithm.name} learns from"
                )
        except RecordError as error:
            self.rejected.add(error.reason, str(error))
            return None
        lag = self.version - trajectory.policy_version
        if self.learner.experience == "trajectories" and lag > self.config.trainer.max_policy_lag:
            self.chunks_rejected_stale += 1
            self._unreported["chunks_rejected_stale"] += 1
            return None
        self.lag.record(lag)
        self._unreported[f"chunks_lag_{lag}"] += 1
        return trajectory

    def learn(self, trajectories: list[Trajectory]) -> bool:
        """One update, undone (the learner's whole state restored) if it leaves a NaN or an infinity in the loss
        or the parameters. TrainingDiverged after ``max_nonfinite_updates`` in a row."""
        assert self.learner is not None
        learner = self.learner
        losses, bad = self.guard.update(learner.core, learner, lambda: learner.learn(trajectories))
        if not bad:
            self.losses = losses
            return True
        limit = self.config.trainer.max_nonfinite_updates
        log.warning(
            "update undone: NaN or infinity in %s (%d in a row; the trainer stops at %d)",
            ", ".join(bad),
            self.guard.in_a_row,
            limit,
        )
        if self.guard.in_a_row >= limit:
            raise TrainingDiverged(
                f"{limit} updates in a row came out NaN or infinite (the last in {', '.join(bad)}); the "
                f"parameters are those of policy version {self.version}: lower the learning rate "
                "or check the env's rewards and observations"
            )
        return False

    def train(self, stop: threading.Event) -> None:
        assert self.learner is not None
        reader = ExperienceReader(self.client, self.run, signing_key("experience"))
        pending: list[Trajectory] = []
        wanted, have = self.config.trainer.samples_per_update, 0
        chunk_size = wanted  # env steps of the last chunk seen: the first take is of one chunk
        while not stop.is_set():
            try:
                self.sync_redis()
                raw = reader.take(count=math.ceil((wanted - have) / chunk_size), block_ms=500)
            except redis.RedisError as error:
                log.warning("Redis unreachable (%s); retrying", error)
                stop.wait(1.0)
                continue
            accepted = [c for c in map(self.accept, raw) if c is not None]
            pending.extend(accepted)
            have += sum(c.num_steps for c in accepted)
            chunk_size = accepted[-1].num_steps if accepted else chunk_size
            self.chunks_consumed += len(raw)
            if have < wanted:
                continue
            start = time.monotonic()
            learned = self.learn(pending)
            self.busy.record(start, time.monotonic())
            batch_steps, pending, have = have, [], 0
            if not learned:
                continue
            self.version += 1
            self.updates += 1
            self.env_steps_trained += batch_steps
            try:
                self.publish()
            except redis.RedisError as error:
                log.warning("cannot publish version %d (%s); will retry", self.version, error)
            self.evaluation.after_update(self.updates, self.learner.core)
            policy = self.config.trainer.checkpoint
            overdue = time.monotonic() - self._last_checkpoint >= policy.every_seconds
            if (overdue or self.updates % policy.every_updates == 0) and self.checkpoint_writes.due():
                self.checkpoint()
