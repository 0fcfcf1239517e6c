"""The trainer service: consumes chunks, learns, publishes versioned weights, checkpoints.

Chunks acted by a policy more than ``max_policy_lag`` versions old are rejected and counted. The policy
version only goes up: on start it resumes from the latest checkpoint and never publishes a version below
the one already in Redis.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import grpc
import redis
import torch

from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.algorithms.ppo.networks import policy_spec, weights_from_bytes
from tinker_atropos.config import Config
from tinker_atropos.environment.spaces import space_from_proto
from tinker_atropos.protocol.chunks import ChunkArrays, decode_chunk
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc, services_pb2, services_pb2_grpc
from tinker_atropos.rollout.service import resolve_device
from tinker_atropos.runtime import (
    Endpoint,
    ServiceHost,
    configure_logging,
    limit_blas_threads,
    status_figures,
    stop_on_signals,
)
from tinker_atropos.state.checkpoints import load_latest_checkpoint, save_checkpoint
from tinker_atropos.state.connection import connect
from tinker_atropos.state.experience import ExperienceReader, add_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, published_version
from tinker_atropos.trainer.metrics import BusyMeter, LagMeter

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0


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
        )

    def figures(self) -> dict:
        return status_figures(self.status())

    def GetStatus(self, request, context) -> services_pb2.TrainerStatus:  # noqa: N802 - gRPC name
        return self.status()

    # -- state ---------------------------------------------------------------------------------------
    def setup(self, info: environment_pb2.EnvironmentInfo) -> None:
        tc = self.config.trainer
        restored = load_latest_checkpoint(self.checkpoint_dir)
        spec = policy_spec(
            space_from_proto(info.observation_space),
            space_from_proto(info.action_space),
            tc.model,
            tc.ppo.normalize_observations,
            tc.ppo.normalize_returns,
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
        published = fetch_weights(self.client, self.run)
        if published is None or published.version <= self.version:
            return
        if published.spec == self.learner.spec:
            self.learner.model.load_state_dict(weights_from_bytes(published.blob))
            log.info("continuing from the weights of version %d found in Redis", published.version)
            self.version = published.version
        else:
            log.warning("Redis holds version %d of another model; continuing above it", published.version)
            self.version = published.version + 1

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
        if self._stale_unreported:
            add_stats(self.client, self.run, chunks_rejected_stale=self._stale_unreported)
            self._stale_unreported = 0
        if (published_version(self.client, self.run) or -1) < self.version:
            log.info("Redis lacks policy version %d; publishing it again", self.version)
            self.publish()
        self._last_sync = now

    # -- learning ------------------------------------------------------------------------------------
    def accept(self, data: bytes) -> ChunkArrays | None:
        try:
            chunk = decode_chunk(data)
        except ValueError as error:
            log.warning("skipping a malformed chunk: %s", error)
            return None
        lag = max(0, self.version - chunk.policy_version)
        if lag > self.config.trainer.max_policy_lag:
            self.chunks_rejected_stale += 1
            self._stale_unreported += 1
            return None
        self.lag.record(lag)
        return chunk

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
            self.losses = self.learner.update(pending)
            self.version += 1
            self.updates += 1
            self.env_steps_trained += have
            self.busy.record(start, time.monotonic())
            pending, have = [], 0
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
    client = connect(redis_url)
    servicer = TrainerServicer(config, client, run_dir)
    service = ServiceHost("trainer", config, client, endpoint, servicer.figures)
    servicer.incarnation = service.incarnation
    services_pb2_grpc.add_TrainerServicer_to_server(servicer, service.server)
    service.start()
    info = describe_env(client, config.run.name, stop)
    if info is not None:
        servicer.setup(info)
        servicer.train(stop)
        servicer.checkpoint()
    service.stop()
