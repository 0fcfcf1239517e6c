"""The environment service: hosts instances of one env and steps them over one bidi stream per session.

A session claims some of the service's instances for as long as its stream lives; a malformed request ends
only its own stream (INVALID_ARGUMENT), never the service or the other sessions. The same session logic
serves the gRPC stream and the local fast path for co-located rollouts (``local_server``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
import gymnasium as gym

from tinker_atropos.config import Config
from tinker_atropos.environment.backends.base import make_env_batch
from tinker_atropos.environment.episodes import EpisodeTracker
from tinker_atropos.environment.local_server import LocalSessionServer
from tinker_atropos.environment.spaces import ActionError, check_actions, space_to_proto
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc
from tinker_atropos.runtime import (
    Endpoint,
    ServiceHost,
    configure_logging,
    limit_blas_threads,
    stop_on_signals,
)
from tinker_atropos.state.connection import connect

log = logging.getLogger(__name__)

Abort = Callable[[grpc.StatusCode, str], NoReturn]


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, config: Config, capacity: int) -> None:
        self.env = config.env
        self.capacity = capacity
        probe = gym.make(self.env.id, **self.env.kwargs)  # fails fast on a bad id or kwargs
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        probe.close()
        space_to_proto(self.action_space)  # unsupported spaces are refused at start, not mid-run
        self.incarnation = ""
        self.local_address = ""
        self._lock = threading.Lock()
        self._sessions: dict[str, int] = {}  # session id -> instances held
        self.steps = 0
        self.episodes = 0

    @property
    def free_instances(self) -> int:
        return self.capacity - sum(self._sessions.values())

    def figures(self) -> dict[str, int | str]:
        return {
            "env_id": self.env.id,
            "instances": self.capacity,
            "free_instances": self.free_instances,
            "sessions": len(self._sessions),
            "steps": self.steps,
            "episodes": self.episodes,
        }

    def Describe(self, request, context) -> environment_pb2.EnvironmentInfo:  # noqa: N802 - gRPC name
        return environment_pb2.EnvironmentInfo(
            env_id=self.env.id,
            observation_space=space_to_proto(self.observation_space),
            action_space=space_to_proto(self.action_space),
            num_instances=self.capacity,
            free_instances=self.free_instances,
            incarnation=self.incarnation,
            backend=self.env.backend,
            local_address=self.local_address,
        )

    def _claim(self, wanted: int, abort: Abort) -> tuple[str, int]:
        with self._lock:
            free = self.free_instances
            n = wanted or free
            if n == 0 or n > free:
                abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{n or 'any'} instances asked, {free} of {self.capacity} free",
                )
            session_id = uuid.uuid4().hex
            self._sessions[session_id] = n
            return session_id, n

    def Session(  # noqa: N802 - gRPC name
        self, request_iterator: Iterator[environment_pb2.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[environment_pb2.SessionResponse]:
        return self.session(request_iterator, context.abort)

    def session(
        self, request_iterator: Iterator[environment_pb2.SessionRequest], abort: Abort
    ) -> Iterator[environment_pb2.SessionResponse]:
        """One session, whatever carries it: ``abort`` ends it with a status and never returns."""
        first = next(request_iterator, None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request of a session must be 'open'")
        session_id, n = self._claim(first.open.num_instances, abort)
        batch = None
        try:
            batch = make_env_batch(self.env.backend, self.env.id, self.env.kwargs, n, self.env.threads)
            observations = batch.reset(first.open.seed)
            log.info("session %s opened: %d instances", session_id[:8], n)
            yield environment_pb2.SessionResponse(
                opened=environment_pb2.SessionOpened(
                    session_id=session_id,
                    incarnation=self.incarnation,
                    num_instances=n,
                    observations=tensors.encode(observations),
                )
            )
            tracker = EpisodeTracker(n)
            for request in request_iterator:
                actions = self._actions(request, session_id, n, abort)
                step = batch.step(actions)
                ended = tracker.update(step.rewards, step.terminated, step.truncated)
                self.steps += n
                self.episodes += len(ended)
                yield environment_pb2.SessionResponse(
                    step=environment_pb2.StepResult(
                        observations=tensors.encode(step.observations),
                        rewards=tensors.encode(step.rewards),
                        terminated=tensors.encode(step.terminated),
                        truncated=tensors.encode(step.truncated),
                        final_observations=tensors.encode(step.final_observations),
                        final_indices=tensors.encode(step.final_indices),
                        episodes=ended,
                    )
                )
        finally:
            if batch is not None:
                batch.close()
            with self._lock:
                del self._sessions[session_id]
            log.info("session %s closed, %d instances released", session_id[:8], n)

    def _actions(self, request, session_id: str, n: int, abort: Abort):
        if request.WhichOneof("kind") != "step":
            abort(grpc.StatusCode.INVALID_ARGUMENT, "a session is opened once; send 'step' requests")
        if request.step.session_id != session_id:
            abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown session {request.step.session_id!r}: this stream serves session {session_id!r}",
            )
        try:
            return check_actions(tensors.decode(request.step.actions), self.action_space, n)
        except (ActionError, tensors.TensorError) as error:
            abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


def serve(config: Config, redis_url: str, endpoint: Endpoint) -> None:
    """Run one environment service until SIGTERM/SIGINT."""
    configure_logging("env")
    limit_blas_threads()
    stop = stop_on_signals()
    servicer = EnvironmentServicer(config, config.env.instances)
    service = ServiceHost(
        "env",
        config,
        connect(redis_url),
        endpoint,
        servicer.figures,
        max_workers=max(8, 2 * config.env.instances + 4),
    )
    servicer.incarnation = service.incarnation
    try:  # the incarnation makes the name unique on the host (a run name could overflow the 107-byte limit)
        local = LocalSessionServer(servicer.session, f"tinker-atropos/env/{service.incarnation}")
    except OSError as error:  # no abstract Unix sockets (not Linux): rollouts use gRPC
        log.warning("no local fast path: %s", error)
        local = None
    environment_pb2_grpc.add_EnvironmentServicer_to_server(servicer, service.server)
    if local is not None:
        servicer.local_address = local.address
        local.start()
    service.start()
    # A timed wait: the kernel may hand SIGTERM to any thread (it does right after a SIGCONT), and then only a
    # main thread that wakes up by itself runs the Python handler. An untimed wait ignored SIGTERM for good.
    while not stop.wait(0.5):
        pass
    if local is not None:
        local.stop()
    service.stop()
