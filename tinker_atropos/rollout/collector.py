"""Where experience is collected: one env session on one unit of work (a session slot of an env service whose lease
this rollout holds), SEED RL style — one stream, one loop, one reconnect with backoff.

The loop acts on the latest observations with the current policy, sends the actions of every instance in one
message (``environment/client.py``, over the local fast path or gRPC), and appends the answer to the trajectory
being built. The policy only changes between chunks, so each chunk is acted by a single version. When the stream
breaks, the partial chunk is dropped (never stitched onto the next incarnation) and the loop reconnects.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import redis

from tinker_atropos.config import RolloutSection
from tinker_atropos.environment.client import EnvClient, EnvDescription, EnvSession
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.rollout.assignment import Unit
from tinker_atropos.rollout.policy import PolicySource, VersionedPolicy
from tinker_atropos.rollout.trajectory_builder import TrajectoryBuilder
from tinker_atropos.state.experience import ExperienceWriter

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
BUSY_RETRY_S = 0.2
HANDOVER_WAIT_S = 2.0
PAUSE_POLL_S = 0.005


def _status(error: Exception) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.RpcError) and hasattr(error, "code") else None


def _reason(error: Exception) -> str:
    code = _status(error)
    return f"{code.name}: {error.details()}" if code is not None else str(error)


def truncation_values(step: StepBatch, policy: VersionedPolicy, num_instances: int) -> np.ndarray | None:
    """The value of each instance's last observation where the time limit cut its episode (the return there
    is bootstrapped, not zero); None on the many steps where none was cut, or for a policy without a critic."""
    if not step.final_indices.size or not policy.has_critic:
        return None
    instances, finals = step.truncated_finals()
    if not instances.size:
        return None
    values = np.zeros(num_instances, np.float32)
    values[instances] = policy.value(finals)
    return values


class SessionCounters:
    """Figures shared by all sessions of a rollout service (updated under the GIL, read by heartbeats)."""

    def __init__(self) -> None:
        self.env_steps = 0
        self.chunks_written = 0
        self.partial_chunks_dropped = 0
        self.episodes = 0
        self.sessions_lost = 0
        self.recent_returns: collections.deque[float] = collections.deque(maxlen=100)
        # unit key -> (env service name, instances) of open sessions
        self.open: dict[str, tuple[str, int]] = {}

    @property
    def connected(self) -> int:
        return len(self.open)

    def instances_by_env(self) -> dict[str, int]:
        held: collections.Counter[str] = collections.Counter()
        for env, n in list(self.open.values()):
            held[env] += n
        return dict(held)


@dataclass(frozen=True)
class SessionContext:
    """What every session of one rollout service shares: where it acts from and writes to, and what it reports."""

    policy: PolicySource
    writer: ExperienceWriter
    rollout_incarnation: str
    counters: SessionCounters
    in_view: Callable[[str], bool]  # whether a unit key is still in the registry's view
    pause_at_samples: int | None  # flow control "pause": wait while a batch of this many samples is queued


class Collector(threading.Thread):
    """Keeps one session open on ``unit``'s env service, turning its steps into trajectories, until ``halt``
    (at once: the service stops or the unit's lease was lost), ``release`` (once the chunk in progress is
    written: the unit goes to another rollout), or the unit's env service is gone."""

    def __init__(self, unit: Unit, seed: int, section: RolloutSection, context: SessionContext) -> None:
        super().__init__(name=f"session-{unit.address}-{unit.slot}", daemon=True)
        self.unit, self.seed = unit, seed
        self.chunk_length, self.first_backoff_s = section.chunk_length, section.reconnect_backoff_s
        self.transport = section.transport
        self.policy, self.writer = context.policy, context.writer
        self.rollout_incarnation, self.counters = context.rollout_incarnation, context.counters
        self.in_view, self.pause_at_samples = context.in_view, context.pause_at_samples
        self.halt, self.release = threading.Event(), threading.Event()
        self.opened_once = False
        self.env_replaced = False  # the env service at the address is another incarnation: the unit is gone

    def _ending(self) -> bool:
        return self.halt.is_set() or self.release.is_set()

    def run(self) -> None:
        backoff, attempt, where = self.first_backoff_s, 0, f"{self.unit.address}/{self.unit.slot}"
        while not self._ending():
            try:
                with EnvClient(self.unit.address, self.transport, self.halt) as client:
                    # a new seed per attempt: a reconnect does not replay the same initial states
                    self._serve(client, self.seed + attempt * 1000)
                return  # stopped cleanly, or the env service there is another incarnation: the unit is gone
            except (grpc.RpcError, redis.RedisError) as error:
                if self._ending():  # our own drain ended the stream: not a loss to report
                    return
                # env service gone or Redis away: the partial chunk is dropped, never stitched
                self.counters.sessions_lost += 1
                if self.opened_once:
                    backoff, self.opened_once = self.first_backoff_s, False
                log.warning("session %s lost: %s; retrying in %.1fs", where, _reason(error), backoff)
                busy = _status(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(error, grpc.RpcError) and not busy and not self.in_view(self.unit.key):
                    log.info(
                        "env service %s left the registry; session %d ends", self.unit.address, self.unit.slot
                    )
                    return
                if busy:  # its instances are being freed by the session before (a hand-over): soon free
                    backoff = min(backoff, BUSY_RETRY_S)
            attempt += 1
            if self.halt.wait(backoff) or self.release.is_set():
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def wait_for_trainer(self, queued: int, chunk_size: int) -> None:
        """Flow control 'pause': while a full batch is already queued, more steps would only go stale. The
        queued chunks are counted as ``chunk_size`` env steps each, this session's."""
        if self.pause_at_samples is None:
            return
        while queued * chunk_size >= self.pause_at_samples and not self.halt.wait(PAUSE_POLL_S):
            if self.release.is_set():
                return
            queued = self.writer.queued()

    def _wait_for_policy(self) -> VersionedPolicy | None:
        while not self._ending():
            policy = self.policy.refresh()
            if policy is not None:
                return policy
            self.halt.wait(0.5)
        return None

    def _serve(self, client: EnvClient, seed: int) -> None:
        env, unit = client.describe(), self.unit
        if env.incarnation != unit.env_incarnation:  # restarted: its slots are new units, leased anew
            self.env_replaced = True
            log.info(
                "env service %s is now incarnation %s; slot %d of %s ends",
                unit.address,
                env.incarnation,
                unit.slot,
                unit.env_incarnation,
            )
            return
        policy = self._wait_for_policy()
        if policy is None:
            return
        session = client.open(unit.instances, seed)
        try:
            self.counters.open[unit.key] = (unit.env_name, session.num_instances)
            self.opened_once = True
            log.info(
                "session %s/%d open over %s: %d instances of env incarnation %s",
                unit.address,
                unit.slot,
                session.carrier,
                session.num_instances,
                session.incarnation,
            )
            try:
                self._collect(session, env, policy)
            finally:
                del self.counters.open[unit.key]
        finally:  # handing over: the instances freed before the lease is, so the next holder finds them free
            session.close(HANDOVER_WAIT_S if self.release.is_set() else 0.0)

    def _builder(self, env: EnvDescription, n: int, policy: VersionedPolicy) -> TrajectoryBuilder:
        return TrajectoryBuilder(
            self.chunk_length,
            n,
            env.observation_space.shape,
            env.action_space.shape,
            env.action_dtype,
            with_values=policy.has_critic,
        )

    def _collect(self, session: EnvSession, env: EnvDescription, policy: VersionedPolicy) -> None:
        n, action_dtype = session.num_instances, env.action_dtype
        builder = self._builder(env, n, policy)
        observations = session.observations
        try:
            while not self.halt.is_set():
                actions, log_probs, values = policy.act(observations)
                actions = actions.astype(action_dtype, copy=False)
                step = session.step(actions)
                builder.add(
                    observations, actions, log_probs, values, step, truncation_values(step, policy, n)
                )
                observations = step.observations
                if builder.full:
                    episodes = [{"return": e.episode_return, "length": e.length} for e in builder.episodes]
                    cut = sum(e.cut_nonfinite for e in builder.episodes)
                    chunk = builder.finish(
                        observations,
                        policy.value(observations) if policy.has_critic else None,
                        policy.version,
                        self.rollout_incarnation,
                        self.writer.next_sequence(),
                        session.incarnation,
                        session.session_id,
                    )
                    queued = self.writer.append(chunk, n * self.chunk_length, episodes, cut) + 1
                    self.counters.chunks_written += 1
                    self.counters.env_steps += n * self.chunk_length
                    self.counters.episodes += len(episodes)
                    self.counters.recent_returns.extend(e["return"] for e in episodes)
                    self.wait_for_trainer(queued, n * self.chunk_length)
                    refreshed = self.policy.refresh() or policy
                    if refreshed.has_critic != policy.has_critic:  # another kind of policy: values or none
                        builder = self._builder(env, n, refreshed)
                    policy = refreshed
                    if self.release.is_set():  # handed over between chunks: nothing is lost
                        return
        finally:
            if builder.steps:
                self.counters.partial_chunks_dropped += 1
