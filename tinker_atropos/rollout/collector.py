"""Where experience is collected: one env session, SEED RL style — one stream, one loop, one reconnect with
backoff.

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

import grpc
import numpy as np
import redis

from tinker_atropos.config import Transport
from tinker_atropos.environment.client import EnvClient, EnvDescription, EnvSession
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.rollout.policy import PolicySource, VersionedPolicy
from tinker_atropos.rollout.trajectory_builder import TrajectoryBuilder
from tinker_atropos.state.experience import ExperienceWriter

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
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
        self.connected = 0
        self.sessions_lost = 0
        self.recent_returns: collections.deque[float] = collections.deque(maxlen=100)


class Collector(threading.Thread):
    """Keeps one session open on the env service at ``address``, turning its steps into trajectories, until
    ``stop`` is set or the address leaves the registry."""

    def __init__(
        self,
        address: str,
        slot: int,
        slots: int,
        seed: int,
        chunk_length: int,
        policy: PolicySource,
        writer: ExperienceWriter,
        rollout_incarnation: str,
        counters: SessionCounters,
        still_registered: Callable[[str], bool],
        stop: threading.Event,
        backoff_s: float,
        pause_at_samples: int | None,
        transport: Transport,
    ) -> None:
        super().__init__(name=f"session-{address}-{slot}", daemon=True)
        self.address, self.slot, self.slots, self.seed = address, slot, slots, seed
        self.chunk_length, self.policy, self.writer = chunk_length, policy, writer
        self.rollout_incarnation, self.counters = rollout_incarnation, counters
        self.still_registered, self.stop, self.first_backoff_s = still_registered, stop, backoff_s
        self.pause_at_samples, self.transport = pause_at_samples, transport
        self.opened_once = False

    def run(self) -> None:
        backoff, attempt = self.first_backoff_s, 0
        while not self.stop.is_set():
            try:
                with EnvClient(self.address, self.transport, self.stop) as client:
                    # a new seed per attempt: a reconnect does not replay the same initial states
                    self._serve(client, self.seed + attempt * 1000)
                return  # stopped cleanly
            except (grpc.RpcError, redis.RedisError) as error:
                if self.stop.is_set():  # our own drain ended the stream: not a loss to report
                    return
                # env service gone or Redis away: the partial chunk is dropped, never stitched
                self.counters.sessions_lost += 1
                if self.opened_once:
                    backoff, self.opened_once = self.first_backoff_s, False
                log.warning(
                    "session %s/%d lost: %s; retrying in %.1fs",
                    self.address,
                    self.slot,
                    _reason(error),
                    backoff,
                )
                busy = _status(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(error, grpc.RpcError) and not busy and not self.still_registered(self.address):
                    log.info("env service %s left the registry; session %d ends", self.address, self.slot)
                    return
            attempt += 1
            if self.stop.wait(backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def wait_for_trainer(self, queued: int, chunk_size: int) -> None:
        """Flow control 'pause': while a full batch is already queued, more steps would only go stale. The
        queued chunks are counted as ``chunk_size`` env steps each, this session's."""
        if self.pause_at_samples is None:
            return
        while queued * chunk_size >= self.pause_at_samples and not self.stop.wait(PAUSE_POLL_S):
            queued = self.writer.queued()

    def _wait_for_policy(self) -> VersionedPolicy | None:
        while not self.stop.is_set():
            policy = self.policy.refresh()
            if policy is not None:
                return policy
            self.stop.wait(0.5)
        return None

    def _serve(self, client: EnvClient, seed: int) -> None:
        env = client.describe()
        policy = self._wait_for_policy()
        if policy is None:
            return
        n = env.num_instances // self.slots + (self.slot < env.num_instances % self.slots)
        session = client.open(n, seed)
        try:
            self.counters.connected += 1
            self.opened_once = True
            log.info(
                "session %s/%d open over %s: %d instances of env incarnation %s",
                self.address,
                self.slot,
                session.carrier,
                session.num_instances,
                session.incarnation,
            )
            try:
                self._collect(session, env, policy)
            finally:
                self.counters.connected -= 1
        finally:
            session.close()

    def _builder(self, env: EnvDescription, n: int, policy: VersionedPolicy) -> TrajectoryBuilder:
        return TrajectoryBuilder(self.chunk_length, n, env.observation_space.shape, env.action_space.shape,
                                 env.action_dtype, with_values=policy.has_critic)  # fmt: skip

    def _collect(self, session: EnvSession, env: EnvDescription, policy: VersionedPolicy) -> None:
        n, action_dtype = session.num_instances, env.action_dtype
        builder = self._builder(env, n, policy)
        observations = session.observations
        try:
            while not self.stop.is_set():
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
        finally:
            if builder.steps:
                self.counters.partial_chunks_dropped += 1
