"""The rollout service: discovers env services in the registry and keeps collectors (one session each) open on
every one of them; acts with the latest published policy, whatever algorithm learned it."""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import numpy as np
import redis

from tinker_atropos import runtime
from tinker_atropos.config import Config
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.rollout.collector import Collector, SessionCounters
from tinker_atropos.rollout.policy import PolicySource
from tinker_atropos.runtime import Endpoint, resolve_device
from tinker_atropos.security import signing_key
from tinker_atropos.state.experience import ExperienceWriter
from tinker_atropos.state.registry import live_services

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.5
DRAIN_TIMEOUT_S = 5.0


class RolloutService:
    def __init__(self, config: Config, client: redis.Redis, incarnation: str) -> None:
        self.config, self.client, self.incarnation = config, client, incarnation
        self.counters = SessionCounters()
        device = config.rollout.device  # "auto" only imports torch, to look for CUDA
        device = str(resolve_device(device)) if device == "auto" else device
        self.policy = PolicySource(client, config.run.name, device, config.trainer.model.network)
        self.writer = ExperienceWriter(
            client, config.run.name, config.rollout.max_queued_chunks, signing_key("experience")
        )
        self.sessions: dict[tuple[str, int], Collector] = {}
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
            episode_return_mean=float(np.mean(c.recent_returns)) if c.recent_returns else 0.0,
            sessions_lost=c.sessions_lost,
        )

    def add_to(self, server: grpc.Server) -> None:
        """No RPCs of its own besides health and status."""

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(DISCOVERY_INTERVAL_S):
            self.discover(stop)
        deadline = (
            time.monotonic() + DRAIN_TIMEOUT_S
        )  # collectors finish their step; one waiting on Redis is left
        for session in self.sessions.values():
            session.join(timeout=max(0.0, deadline - time.monotonic()))

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
                session = Collector(
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

    def build(client: redis.Redis, incarnation: str) -> RolloutService:
        # acting on a few dozen observations gains nothing from threads; torch, when a user network or a GPU
        # makes the rollout import it, reads this as it loads
        os.environ["OMP_NUM_THREADS"] = "1"
        return RolloutService(config, client, incarnation)

    runtime.serve("rollout", config, redis_url, endpoint, build)
