"""The rollout service: discovers env services in the registry and keeps sessions open on each of them."""

from __future__ import annotations

import logging
import threading
import time

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.protocol.v1 import services_pb2, services_pb2_grpc
from tinker_atropos.rollout.env_session import EnvSession, SessionCounters
from tinker_atropos.rollout.policy import PolicySource
from tinker_atropos.runtime import (
    Endpoint,
    ServiceHost,
    configure_logging,
    limit_blas_threads,
    status_figures,
    stop_on_signals,
)
from tinker_atropos.state.connection import connect_when_reachable
from tinker_atropos.state.experience import ExperienceWriter
from tinker_atropos.state.registry import live_services

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.5
DRAIN_TIMEOUT_S = 5.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class RolloutServicer(services_pb2_grpc.RolloutServicer):
    def __init__(self, config: Config, client: redis.Redis) -> None:
        self.config, self.client = config, client
        self.incarnation = ""
        self.counters = SessionCounters()
        self.policy = PolicySource(client, config.run.name, resolve_device(config.rollout.device))
        self.writer = ExperienceWriter(client, config.run.name, config.rollout.max_queued_chunks)
        self.sessions: dict[tuple[str, int], EnvSession] = {}
        self._env_addresses: set[str] = set()
        pausing = config.rollout.flow_control == "pause"
        self.pause_at_samples = config.trainer.samples_per_update if pausing else None
        self._sessions_started = 0  # numbers the sessions, so seeds are reproducible

    def status(self) -> services_pb2.RolloutStatus:
        c = self.counters
        return services_pb2.RolloutStatus(
            incarnation=self.incarnation,
            policy_version=self.policy.version or 0,
            env_steps=c.env_steps,
            chunks_written=c.chunks_written,
            partial_chunks_dropped=c.partial_chunks_dropped,
            connected_sessions=c.connected,
            episodes=c.episodes,
            weights_rejected=self.policy.rejected,
        )

    def figures(self) -> dict:
        return status_figures(self.status())

    def GetStatus(self, request, context) -> services_pb2.RolloutStatus:  # noqa: N802 - gRPC name
        return self.status()

    def discover(self, stop: threading.Event) -> None:
        """Open the missing sessions: one per (env service, slot), restarted when its thread ended."""
        try:
            self._env_addresses = {s.address for s in live_services(self.client, self.config.run.name, "env")}
        except redis.RedisError as error:
            log.warning("registry unreadable (%s); keeping current sessions", error)
            return
        slots = self.config.rollout.sessions_per_env
        for address in sorted(self._env_addresses):
            for slot in range(slots):
                session = self.sessions.get((address, slot))
                if session is not None and session.is_alive():
                    continue
                self._sessions_started += 1
                seed = self.config.run.seed * 1_000_000 + self._sessions_started * 10_000
                session = EnvSession(
                    address,
                    slot,
                    slots,
                    seed,
                    self.config.rollout.chunk_length,
                    self.policy,
                    self.writer,
                    self.incarnation,
                    self.counters,
                    lambda a: a in self._env_addresses,
                    stop,
                    self.config.rollout.reconnect_backoff_s,
                    self.pause_at_samples,
                    self.config.rollout.transport,
                )
                self.sessions[(address, slot)] = session
                session.start()


def serve(config: Config, redis_url: str, endpoint: Endpoint) -> None:
    """Run one rollout service until SIGTERM/SIGINT."""
    configure_logging("rollout")
    limit_blas_threads()
    torch.set_num_threads(1)  # acting on a few dozen observations gains nothing from threads
    stop = stop_on_signals()
    client = connect_when_reachable(redis_url, config.redis.unreachable_timeout_s, stop)
    if client is None:
        return
    servicer = RolloutServicer(config, client)
    service = ServiceHost("rollout", config, client, endpoint, servicer.figures)
    servicer.incarnation = service.incarnation
    services_pb2_grpc.add_RolloutServicer_to_server(servicer, service.server)
    service.start()
    while not stop.wait(DISCOVERY_INTERVAL_S):
        servicer.discover(stop)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S  # sessions finish their step; one waiting on Redis is left
    for session in servicer.sessions.values():
        session.join(timeout=max(0.0, deadline - time.monotonic()))
    service.stop()
