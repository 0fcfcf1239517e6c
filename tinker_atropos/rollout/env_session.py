"""One environment session, SEED RL style: one bidi stream, one loop, one reconnect with backoff.

The stream is the env service's local fast path when it runs on this host, else its gRPC ``Session``
(``env_streams``); the loop below is the same for both.

The loop acts on the latest observations with the current policy, sends the actions of every instance in one
message, and appends the result to the chunk being built. The policy only changes between chunks, so each
chunk is acted by a single version. When the stream breaks, the partial chunk is dropped (never stitched
onto the next incarnation) and the loop reconnects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import numpy as np
import redis

from tinker_atropos.config import Transport
from tinker_atropos.environment.spaces import space_from_proto
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc
from tinker_atropos.rollout.chunks import ChunkBuilder
from tinker_atropos.rollout.env_streams import LocalStreamError, SessionStream, open_stream
from tinker_atropos.rollout.policy import PolicySource, VersionedPolicy
from tinker_atropos.runtime import GRPC_OPTIONS
from tinker_atropos.state.experience import ExperienceWriter

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
PAUSE_POLL_S = 0.005
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", 2000),  # notice a peer that stopped answering (SIGSTOP, cut link)
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _status(error: Exception) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.Call | LocalStreamError) else None


def _reason(error: Exception) -> str:
    code = _status(error)
    return f"{code.name}: {error.details()}" if code is not None else str(error)


def _truncation_values(
    result: environment_pb2.StepResult, policy: VersionedPolicy, num_instances: int
) -> np.ndarray | None:
    """The value of each instance's last observation where the time limit cut its episode (the return there
    is bootstrapped, not zero); None on the many steps where no episode ended."""
    if not result.final_indices.data:
        return None
    final_indices = tensors.decode(result.final_indices)
    truncated = tensors.decode(result.truncated)[final_indices]
    if not truncated.any():
        return None
    values = np.zeros(num_instances, np.float32)
    finals = tensors.decode(result.final_observations)[truncated]
    values[final_indices[truncated]] = policy.value(finals)
    return values


class SessionCounters:
    """Figures shared by all sessions of a rollout service (updated under the GIL, read by heartbeats)."""

    def __init__(self) -> None:
        self.env_steps = 0
        self.chunks_written = 0
        self.partial_chunks_dropped = 0
        self.episodes = 0
        self.connected = 0


class EnvSession(threading.Thread):
    """Keeps one session open on the env service at ``address`` until ``stop`` is set or the address
    leaves the registry."""

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
                with grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
                    # a new seed per attempt: a reconnect does not replay the same initial states
                    self._serve(environment_pb2_grpc.EnvironmentStub(channel), self.seed + attempt * 1000)
                return  # stopped cleanly
            except (grpc.RpcError, redis.RedisError) as error:
                if self.stop.is_set():  # our own drain ended the stream: not a loss to report
                    return
                # env service gone or Redis away: the partial chunk is dropped, never stitched
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

    def _serve(self, stub: environment_pb2_grpc.EnvironmentStub, seed: int) -> None:
        info = stub.Describe(environment_pb2.DescribeRequest(), timeout=10)
        policy = self._wait_for_policy()
        if policy is None:
            return
        n = info.num_instances // self.slots + (self.slot < info.num_instances % self.slots)
        action_space = space_from_proto(info.action_space)
        obs_shape = tuple(info.observation_space.box.shape)
        action_dtype = np.float32 if info.action_space.WhichOneof("kind") == "box" else np.int64

        stream = open_stream(stub, info, self.transport, self.stop)
        try:
            stream.send(
                environment_pb2.SessionRequest(open=environment_pb2.OpenSession(num_instances=n, seed=seed))
            )
            opened = stream.receive().opened
            self.counters.connected += 1
            self.opened_once = True
            log.info(
                "session %s/%d open over %s: %d instances of env incarnation %s",
                self.address,
                self.slot,
                stream.kind,
                opened.num_instances,
                opened.incarnation,
            )
            try:
                self._step_loop(opened, stream, policy, action_space.shape, action_dtype, obs_shape)
            finally:
                self.counters.connected -= 1
        finally:
            stream.close()

    def _step_loop(
        self, opened, stream: SessionStream, policy, action_shape, action_dtype, obs_shape
    ) -> None:
        n, session_id = opened.num_instances, opened.session_id
        builder = ChunkBuilder(self.chunk_length, n, obs_shape, action_shape, action_dtype)
        observations = tensors.decode(opened.observations)
        try:
            while not self.stop.is_set():
                actions, log_probs, values = policy.act(observations)
                actions = actions.astype(action_dtype, copy=False)
                stream.send(
                    environment_pb2.SessionRequest(
                        step=environment_pb2.StepRequest(
                            session_id=session_id, actions=tensors.encode(actions)
                        )
                    )
                )
                result = stream.receive().step
                builder.add(
                    observations, actions, log_probs, values, result, _truncation_values(result, policy, n)
                )
                observations = tensors.decode(result.observations)
                if builder.full:
                    episodes = [{"return": e.episode_return, "length": e.length} for e in builder.episodes]
                    cut = sum(e.cut_nonfinite for e in builder.episodes)
                    chunk = builder.finish(
                        observations,
                        policy.value(observations),
                        policy.version,
                        self.rollout_incarnation,
                        opened.incarnation,
                        session_id,
                    )
                    queued = self.writer.append(chunk, n * self.chunk_length, episodes, cut) + 1
                    self.counters.chunks_written += 1
                    self.counters.env_steps += n * self.chunk_length
                    self.counters.episodes += len(episodes)
                    self.wait_for_trainer(queued, n * self.chunk_length)
                    policy = self.policy.refresh() or policy
        finally:
            if builder.steps:
                self.counters.partial_chunks_dropped += 1
