"""The trainer service: consumes chunks, learns, publishes versioned weights, checkpoints.

Every record read from the stream is checked (``decode_record``) and a bad one is skipped and counted by
reason; chunks acted by a policy more than ``max_policy_lag`` versions old are rejected and counted. An update
that leaves a NaN or an infinity in the loss or the parameters is undone, so non-finite weights are never
published; ``trainer.max_nonfinite_updates`` of them in a row stop the trainer with an error. The policy
version only goes up: on start it resumes from the latest checkpoint and never publishes a version below
the one already in Redis, nor adopts weights from Redis that do not load or are not finite.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from pathlib import Path

import grpc
import redis
import torch

from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.algorithms.ppo.networks import nonfinite_entries, policy_spec, weights_from_bytes
from tinker_atropos.config import Config
from tinker_atropos.environment.spaces import space_from_proto
from tinker_atropos.protocol.chunks import ChunkArrays, RecordError, TrajectorySpec, decode_record
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc, services_pb2, services_pb2_grpc
from tinker_atropos.rollout.service import resolve_device
from tinker_atropos.runtime import (
    CountedWarnings,
    Endpoint,
    FatalError,
    ServiceHost,
    configure_logging,
    limit_blas_threads,
    status_figures,
    stop_on_signals,
)
from tinker_atropos.state.checkpoints import load_latest_checkpoint, save_checkpoint
from tinker_atropos.state.connection import connect_when_reachable
from tinker_atropos.state.experience import ExperienceReader, add_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, published_version
from tinker_atropos.trainer.metrics import BusyMeter, LagMeter

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0


class TrainingDiverged(FatalError):
    """Updates kept coming out non-finite: restarting would not help, the config or the data must change."""


def describe_env(
    client: redis.Redis, run: str, stop: threading.Event
) -> environment_pb2.EnvironmentInfo | None:
    """Spaces come from a live env service, so the trainer needs no simulator installed."""
    while not stop.is_set():
        try:
            records = live_services(client, run, "env")
        except redis.RedisError as error:
            log.warning("registry unreadable (%s); retrying", error)
            records = []
        for record in records:
            try:
                with grpc.insecure_channel(record.address) as channel:
                    stub = environment_pb2_grpc.EnvironmentStub(channel)
                    return stub.Describe(environment_pb2.DescribeRequest(), timeout=5)
            except grpc.RpcError as error:
                log.warning("cannot describe env service %s: %s", record.address, error.code())
        log.info("waiting for an environment service to register")
        stop.wait(1.0)
    return None


class TrainerServicer(services_pb2_grpc.TrainerServicer):
    def __init__(self, config: Config, client: redis.Redis, run_dir: Path) -> None:
        self.config, self.client, self.run = config, client, config.run.name
        self.checkpoint_dir = run_dir / "checkpoints"
        self.device = resolve_device(config.trainer.device)
        self.incarnation = ""
        self.learner: PPOLearner | None = None
        self.version = 0
        self.updates = 0
        self.env_steps_trained = 0
        self.chunks_consumed = 0
        self.chunks_rejected_stale = 0
        self.updates_discarded_nonfinite = 0
        self.nonfinite_in_a_row = 0
        self.rejected = CountedWarnings("experience records skipped")
        self.spec: TrajectorySpec | None = None
        self.losses: dict[str, float] = {}
        self._stale_unreported = 0
        self._last_sync = 0.0
        self._last_checkpoint = time.monotonic()
        self.busy = BusyMeter()
        self.lag = LagMeter()

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
            losses=self.losses,
            records_rejected=self.rejected.totals,
            updates_discarded_nonfinite=self.updates_discarded_nonfinite,
        )

    def figures(self) -> dict:
        return status_figures(self.status())

    def GetStatus(self, request, context) -> services_pb2.TrainerStatus:  # noqa: N802 - gRPC name
        return self.status()

    # -- state ---------------------------------------------------------------------------------------
    def setup(self, info: environment_pb2.EnvironmentInfo) -> None:
        tc = self.config.trainer
        restored = load_latest_checkpoint(self.checkpoint_dir)
        observation_space, action_space = (
            space_from_proto(info.observation_space),
            space_from_proto(info.action_space),
        )
        self.spec = TrajectorySpec.from_spaces(observation_space, action_space)
        spec = policy_spec(
            observation_space, action_space, tc.model, tc.ppo.normalize_observations, tc.ppo.normalize_returns
        )
        if restored is not None:
            path, state = restored
            spec = state["learner"]["spec"]
        self.learner = PPOLearner(spec, tc, self.device, self.config.run.seed)
        if restored is not None:
            self.learner.load_state_dict(state["learner"])
            counters = state["counters"]
            self.version, self.updates = counters["version"], counters["updates"]
            self.env_steps_trained = counters["env_steps_trained"]
            log.info("resumed from %s at policy version %d", path, self.version)
        self.adopt_newer_weights()
        self.publish()

    def adopt_newer_weights(self) -> None:
        """Weights in Redis newer than the checkpoint (a trainer killed between checkpoints) are the policy
        the rollouts act with: continue from them rather than from older parameters, so a restart loses
        only the optimizer moments since the checkpoint and the version stays monotonic."""
        assert self.learner is not None
        try:
            published = fetch_weights(self.client, self.run)
        except (
            ValueError
        ) as error:  # a malformed record: nothing to continue from, the next publish replaces it
            log.warning("the weights record in Redis is malformed (%s); publishing over it", error)
            return
        if published is None or published.version <= self.version:
            return
        if published.spec != self.learner.spec:
            log.warning("Redis holds version %d of another model; continuing above it", published.version)
            self.version = published.version + 1
            return
        try:
            self.learner.model.load_state_dict(weights_from_bytes(published.blob))
        except ValueError as error:  # a NaN in them, or bytes that are not weights: never adopted
            log.warning(
                "not adopting version %d from Redis (%s); continuing above it", published.version, error
            )
            self.version = published.version + 1
            return
        log.info("continuing from the weights of version %d found in Redis", published.version)
        self.version = published.version

    def checkpoint_state(self) -> dict:
        assert self.learner is not None
        return {
            "learner": self.learner.state_dict(),
            "counters": {
                "version": self.version,
                "updates": self.updates,
                "env_steps_trained": self.env_steps_trained,
            },
        }

    def checkpoint(self) -> None:
        path = save_checkpoint(
            self.checkpoint_dir, self.version, self.checkpoint_state(), self.config.trainer.checkpoint.keep
        )
        self._last_checkpoint = time.monotonic()
        log.info("checkpoint %s", path.name)

    def publish(self) -> None:
        assert self.learner is not None
        publish_weights(self.client, self.run, self.version, self.learner.weights(), self.learner.spec)

    def sync_redis(self) -> None:
        """Report counters, and publish again if Redis lost the weights (restarted without persistence)
        or missed the last publication: rollouts must always find the current version."""
        now = time.monotonic()
        if now - self._last_sync < SYNC_INTERVAL_S:
            return
        counts = {f"records_rejected_{k}": n for k, n in self.rejected.take_unreported().items()}
        add_stats(self.client, self.run, chunks_rejected_stale=self._stale_unreported, **counts)
        self._stale_unreported = 0
        try:
            published = published_version(self.client, self.run)
        except ValueError:  # a malformed record: replace it
            published = None
        if published is None or published < self.version:
            log.info("Redis lacks policy version %d; publishing it again", self.version)
            self.publish()
        self._last_sync = now

    # -- learning ------------------------------------------------------------------------------------
    def accept(self, entry: bytes | RecordError) -> ChunkArrays | None:
        """The chunk of a stream entry if it may be learned from; None (counted) for a bad or stale one."""
        assert self.spec is not None
        try:
            if isinstance(entry, RecordError):
                raise entry
            chunk = decode_record(entry, self.spec)
            if chunk.policy_version > self.version:
                raise RecordError(
                    "impossible_version",
                    f"a chunk of policy version {chunk.policy_version}, above the trainer's {self.version}",
                )
        except RecordError as error:
            self.rejected.add(error.reason, str(error))
            return None
        lag = self.version - chunk.policy_version
        if lag > self.config.trainer.max_policy_lag:
            self.chunks_rejected_stale += 1
            self._stale_unreported += 1
            return None
        self.lag.record(lag)
        return chunk

    def learn(self, chunks: list[ChunkArrays]) -> bool:
        """One update, undone (parameters, optimizer and normalisers restored) if it leaves a NaN or an
        infinity in the loss or the parameters. TrainingDiverged after ``max_nonfinite_updates`` in a row."""
        assert self.learner is not None
        saved = copy.deepcopy(self.learner.state_dict())
        losses = self.learner.update(chunks)
        bad = [f"loss {k}" for k, v in losses.items() if not math.isfinite(v)]
        bad += nonfinite_entries(self.learner.model.state_dict())
        if not bad:
            self.losses, self.nonfinite_in_a_row = losses, 0
            return True
        self.learner.load_state_dict(saved)
        self.updates_discarded_nonfinite += 1
        self.nonfinite_in_a_row += 1
        limit = self.config.trainer.max_nonfinite_updates
        log.warning(
            "update undone: NaN or infinity in %s (%d in a row; the trainer stops at %d)",
            ", ".join(bad),
            self.nonfinite_in_a_row,
            limit,
        )
        if self.nonfinite_in_a_row >= limit:
            raise TrainingDiverged(
                f"{limit} updates in a row came out NaN or infinite (the last in {', '.join(bad)}); the "
                f"parameters are those of policy version {self.version}: lower trainer.ppo.learning_rate "
                "or check the env's rewards and observations"
            )
        return False

    def train(self, stop: threading.Event) -> None:
        assert self.learner is not None
        reader = ExperienceReader(self.client, self.run)
        pending: list[ChunkArrays] = []
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
            policy = self.config.trainer.checkpoint
            overdue = time.monotonic() - self._last_checkpoint >= policy.every_seconds
            if overdue or self.updates % policy.every_updates == 0:
                self.checkpoint()


def serve(config: Config, redis_url: str, endpoint: Endpoint, run_dir: Path) -> None:
    """Run the trainer until SIGTERM/SIGINT, then checkpoint and exit."""
    configure_logging("trainer")
    limit_blas_threads()  # before torch sets its own pool, which may be the same BLAS
    torch.set_num_threads(config.trainer.torch_threads)
    stop = stop_on_signals()
    client = connect_when_reachable(redis_url, config.redis.unreachable_timeout_s, stop)
    if client is None:
        return
    servicer = TrainerServicer(config, client, run_dir)
    service = ServiceHost("trainer", config, client, endpoint, servicer.figures)
    servicer.incarnation = service.incarnation
    services_pb2_grpc.add_TrainerServicer_to_server(servicer, service.server)
    service.start()
    try:
        info = describe_env(client, config.run.name, stop)
        if info is not None:
            servicer.setup(info)
            try:
                servicer.train(stop)
            finally:  # also when it diverged: the parameters are the last finite ones
                servicer.checkpoint()
    finally:
        service.stop()
