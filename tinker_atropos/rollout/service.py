"""The rollout service: discovers env services in the registry, takes its share of their session slots beside the
run's other rollouts (leases in Redis, ``rollout/assignment.py``) and keeps a collector (one session each) open on
every slot it holds; acts with the latest published policy, whatever algorithm learned it."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import grpc
import numpy as np
import redis

from tinker_atropos import service_host
from tinker_atropos.config import Config
from tinker_atropos.device import resolve_device
from tinker_atropos.processes import local_host_id
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.rollout.assignment import Unit, assign, units_of
from tinker_atropos.rollout.collector import Collector, SessionContext, SessionCounters
from tinker_atropos.rollout.policy import PolicySource
from tinker_atropos.security import signing_key
from tinker_atropos.service_host import Endpoint
from tinker_atropos.state.experience import ExperienceWriter
from tinker_atropos.state.leases import Leases, Member
from tinker_atropos.state.registry import ServiceRecord, live_services

log = logging.getLogger(__name__)

BALANCE_INTERVAL_S = 0.25
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
        self.leases = Leases(
            client, config.run.name, incarnation, local_host_id(), config.rollout.lease_ttl_s
        )
        self.sessions: dict[str, Collector] = {}  # unit key -> the collector acting on it, its lease held
        self._units: dict[str, Unit] = {}  # the units in the latest view
        self._replaced: set[str] = set()  # env incarnations found restarted while still in the registry
        self._assigned = 0
        self._rollouts = 1
        self.units_handed_over = 0
        self.leases_lost = 0
        self._next_refresh = self._next_discovery = 0.0
        pausing = config.rollout.flow_control == "pause"
        self.context = SessionContext(
            self.policy,
            self.writer,
            incarnation,
            self.counters,
            lambda unit: unit in self._units,
            config.trainer.samples_per_update if pausing else None,
        )
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
            weights_refused=self.policy.refused,
            episode_return_mean=float(np.mean(c.recent_returns)) if c.recent_returns else 0.0,
            sessions_lost=c.sessions_lost,
            instances_held=sum(n for _, n in list(c.open.values())),
            instances_by_env=c.instances_by_env(),
            units_assigned=self._assigned,
            rollouts_seen=self._rollouts,
            units_handed_over=self.units_handed_over,
            leases_lost=self.leases_lost,
            lease_records_skipped=dict(self.leases.skipped),
        )

    def add_to(self, server: grpc.Server) -> None:
        """No RPCs of its own besides health and status."""

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(BALANCE_INTERVAL_S):
            self.balance()
        for session in self.sessions.values():
            session.halt.set()  # collectors finish their step; one waiting on Redis is left
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for session in self.sessions.values():
            session.join(timeout=max(0.0, deadline - time.monotonic()))
        # Redis away: the leases expire, only these counts are lost
        with contextlib.suppress(redis.RedisError):
            self.leases.leave(self.sessions)
            self.policy.report_refusals()

    def balance(self) -> None:
        """One round of sharing the work: keep the leases alive, read who is there, and act on this rollout's
        part of the assignment (``rollout/assignment.py``): open sessions on the units it gains once their lease
        is taken, hand over the units it loses once their chunk is written."""
        now = time.monotonic()
        try:
            # no weights yet (or still loading them): take no share, leave it
            if self.policy.refresh() is None:
                return  # to those that can act; a rollout becomes a member with its first refresh
            if now >= self._next_refresh:
                self._next_refresh = now + self.leases.ttl_ms / 3000
                for unit in self.leases.refresh(self.sessions):
                    log.warning("lease of %s taken by another rollout; its session stops", unit)
                    self.leases_lost += 1
                    self.sessions.pop(unit).halt.set()
            if now >= self._next_discovery:  # the registry is SCANned, so twice a second as before
                self._next_discovery = now + DISCOVERY_INTERVAL_S
                self._units = self._units_of(live_services(self.client, self.config.run.name, "env"))
            members = self.leases.members()
        except redis.RedisError as error:
            if time.monotonic() > self.leases.held_until and self.sessions:
                log.warning(
                    "Redis unreachable past the lease TTL (%s): this rollout's %d sessions stop, since "
                    "another rollout may take their slots",
                    error,
                    len(self.sessions),
                )
                self.leases_lost += len(self.sessions)
                for session in self.sessions.values():
                    session.halt.set()
                self.sessions.clear()
            else:
                log.warning("registry unreadable (%s); keeping current sessions", error)
            return
        try:
            self._act_on(members)
        except redis.RedisError as error:
            log.warning("cannot take or give back leases (%s); trying again", error)

    def _units_of(self, envs: list[ServiceRecord]) -> dict[str, Unit]:
        """The session slots of the live env services; one whose instance count is no number is skipped and
        counted (``lease_records_skipped``: malformed)."""
        self._replaced &= {e.incarnation for e in envs}
        units = {}
        for env in envs:
            instances = env.figures.get("instances", 0)
            if not isinstance(instances, int) or isinstance(instances, bool) or instances < 0:
                self.leases.skipped["malformed"] += 1
                continue
            if env.incarnation not in self._replaced:
                slots = self.config.rollout.sessions_per_env
                units |= {
                    u.key: u
                    for u in units_of(env.incarnation, env.name, env.address, env.host, instances, slots)
                }
        return units

    def _act_on(self, members: list[Member]) -> None:
        for key, session in list(self.sessions.items()):
            # ended by itself (env gone or restarted) or handed over: free its slot
            if not session.is_alive():
                del self.sessions[key]
                self.leases.release(key)
                if session.env_replaced:
                    self._replaced.add(session.unit.env_incarnation)
                if session.release.is_set():
                    self.units_handed_over += 1
        view = self.leases.read(self._units, {m.incarnation for m in members})
        held = {**view.held, **dict.fromkeys(self.sessions, self.incarnation)}
        mine = {
            key
            for key, holder in assign(list(self._units.values()), members, held).items()
            if holder == self.incarnation
        }
        self._assigned, self._rollouts = len(mine), len(members)
        for key, session in self.sessions.items():
            if key in self._units and key not in mine and not session.release.is_set():
                log.info("slot %s goes to another rollout: handing it over after the chunk in progress", key)
                session.release.set()
        for key in sorted(mine - self.sessions.keys()):
            if view.held.get(key, self.incarnation) != self.incarnation:
                continue  # its holder hands it over first
            if not self.leases.claim(key, view.stale.get(key)):
                continue  # taken meanwhile: the next round reads who has it
            self._sessions_started += 1
            seed = self.config.run.seed * 1_000_000 + self._sessions_started * 10_000
            session = Collector(self._units[key], seed, self.config.rollout, self.context)
            self.sessions[key] = session
            session.start()


def serve(config: Config, redis_url: str, endpoint: Endpoint) -> None:
    """Run one rollout service until SIGTERM/SIGINT."""

    def build(client: redis.Redis, incarnation: str) -> RolloutService:
        # acting on a few dozen observations gains nothing from threads; torch, when a user network or a GPU
        # makes the rollout import it, reads this as it loads
        os.environ["OMP_NUM_THREADS"] = "1"
        return RolloutService(config, client, incarnation)

    service_host.serve("rollout", config, redis_url, endpoint, build)
