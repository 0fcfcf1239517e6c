"""The sessions of an env service (``service.py``): each claims some of the service's instances for as long as its
stream lives, taking over sessions whose clients sent nothing past the rollouts' lease TTL when that is what it
takes; it makes its env batch, resets it with the open's seed, and steps it for each step request, reporting the
episodes that end. A request that breaks the protocol ends its own stream only (``refuse``)."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
import gymnasium as gym
import numpy as np

from tinker_atropos.config import EnvSection
from tinker_atropos.environment.backends.base import make_env_batch
from tinker_atropos.environment.episodes import EpisodeTracker
from tinker_atropos.environment.finite import FiniteGuard
from tinker_atropos.environment.spaces import ActionError, check_actions
from tinker_atropos.environment.stream_watch import Stream, StreamControl, StreamWatch
from tinker_atropos.errors import EnvError
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2

log = logging.getLogger(__name__)

TAKEOVER_WAIT_S = 5.0  # how long a new session waits for the sessions it took over to free their instances

# ends a stream for what its client did (``EnvironmentServicer.refuse``); never returns
Refuse = Callable[[StreamControl, grpc.StatusCode, str], NoReturn]


class EnvSessions:
    """The sessions of one env service and the instances they hold, under the stream watch's lock (a takeover
    looks at both at once), and what they served: steps, episodes, episodes cut for NaN or infinity."""

    def __init__(self, env: EnvSection, action_space: gym.Space, watch: StreamWatch, refuse: Refuse) -> None:
        self.env, self.action_space, self.watch, self.refuse = env, action_space, watch, refuse
        self.capacity = env.instances
        self._freed = threading.Condition(watch.lock)  # notified when a session frees its instances
        self.held: dict[str, int] = {}  # session id -> instances held
        self.steps = 0
        self.episodes = 0
        self.cut_nonfinite = CountedWarnings("episodes cut and reset: the env returned NaN or infinity")
        self.refused_busy = 0

    @property
    def free_instances(self) -> int:
        return self.capacity - sum(self.held.values())

    def serve(
        self,
        requests: Iterator[environment_pb2.SessionRequest],
        control: StreamControl,
        stream: Stream,
        incarnation: str,
    ) -> Iterator[environment_pb2.SessionResponse]:
        """One session on ``stream``, from its open request to its end; its instances are freed then."""
        first = next(requests, None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            self.refuse(
                control, grpc.StatusCode.INVALID_ARGUMENT, "the first request of a session must be 'open'"
            )
        session_id, n = self._claim(first.open.num_instances, stream)
        batch = None
        try:
            batch = FiniteGuard(
                make_env_batch(self.env.backend, self.env.id, self.env.kwargs, n, self.env.threads)
            )
            observations = batch.reset(first.open.seed)
            log.info("session %s opened for %s: %d instances", session_id[:8], control.peer, n)
            yield environment_pb2.SessionResponse(
                opened=environment_pb2.SessionOpened(
                    session_id=session_id,
                    incarnation=incarnation,
                    num_instances=n,
                    observations=tensors.encode(observations),
                )
            )
            tracker = EpisodeTracker(n)
            stream.waiting_since = time.monotonic()
            for request in requests:
                stream.waiting_since = math.inf
                actions = self._actions(request, session_id, n, control)
                step, cut = batch.step(actions)
                ended = tracker.update(step.rewards, step.terminated, step.truncated, cut)
                self.steps += n
                self.episodes += len(ended)
                if cut is not None:
                    self.cut_nonfinite.add(
                        f"session {session_id[:8]}", f"instances {cut.nonzero()[0].tolist()}", int(cut.sum())
                    )
                yield environment_pb2.SessionResponse(step=step.encode(ended))
                stream.waiting_since = time.monotonic()
        except EnvError as error:  # the env itself misbehaves past what the guard can repair
            log.warning("session %s failed: %s", session_id[:8], error)
            control.abort(grpc.StatusCode.INTERNAL, str(error))
        finally:
            if batch is not None:
                batch.close()
            with self._freed:
                del self.held[session_id]
                self._freed.notify_all()
            log.info("session %s closed, %d instances released", session_id[:8], n)

    def _claim(self, wanted: int, stream: Stream) -> tuple[str, int]:
        """A new session of ``wanted`` instances (0: all that are free), taking over idle sessions if that is
        what it takes; RESOURCE_EXHAUSTED if the instances are held by clients that still act."""
        with self.watch.lock:
            n = wanted or self.free_instances
            idle = self.watch.idle_holders(n - self.free_instances, time.monotonic())
        self.watch.take_over(idle, stream)
        with self._freed:
            if n > 0 and self._freed.wait_for(
                lambda: n <= self.free_instances, TAKEOVER_WAIT_S if idle else 0
            ):
                session_id = uuid.uuid4().hex
                self.held[session_id] = stream.instances = n
                stream.waiting_since = math.inf  # its envs are being made
                return session_id, n
            free = self.free_instances
        self.refused_busy += 1
        self.refuse(
            stream.control,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{n or 'any'} instances asked, {free} of {self.capacity} free",
        )

    def _actions(
        self, request: environment_pb2.SessionRequest, session_id: str, n: int, control: StreamControl
    ) -> np.ndarray:
        """The actions of a step request of this session, checked against the action space."""
        if request.WhichOneof("kind") != "step":
            self.refuse(
                control, grpc.StatusCode.INVALID_ARGUMENT, "a session is opened once; send 'step' requests"
            )
        if request.step.session_id != session_id:
            self.refuse(
                control,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown session {request.step.session_id!r}: this stream serves session {session_id!r}",
            )
        try:
            return check_actions(tensors.decode(request.step.actions), self.action_space, n)
        except (ActionError, tensors.TensorError) as error:
            self.refuse(control, grpc.StatusCode.INVALID_ARGUMENT, str(error))
