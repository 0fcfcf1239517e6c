"""The client side of the environment contract, written once: describe an env service, open a session over its
local fast path or gRPC (``streams``), step it, and decode each answer into one typed ``StepBatch``.

The rollout collects experience with it, and ``RemoteVectorEnv`` steps it for Gymnasium and SB3 users.
Failures are ``grpc.RpcError`` with a status code, whichever carrier the session uses.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from tinker_atropos.config import Transport
from tinker_atropos.environment.spaces import space_from_proto
from tinker_atropos.environment.streams import SessionStream, open_stream
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc
from tinker_atropos.security import open_channel

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 2000),  # notice a peer that stopped answering (SIGSTOP, cut link)
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class EnvDescription:
    """What ``Describe`` says of an env service, with its spaces as Gymnasium spaces."""

    env_id: str
    observation_space: gym.Space
    action_space: gym.Space
    num_instances: int
    free_instances: int
    incarnation: str
    backend: str
    local_address: str
    # a Dict env's entries; observation_space is its flat Box
    observation_layout: gym.spaces.Dict | None = None

    @classmethod
    def from_proto(cls, info: environment_pb2.EnvironmentInfo) -> EnvDescription:
        return cls(
            env_id=info.env_id,
            observation_space=space_from_proto(info.observation_space),
            action_space=space_from_proto(info.action_space),
            num_instances=info.num_instances,
            free_instances=info.free_instances,
            incarnation=info.incarnation,
            backend=info.backend,
            local_address=info.local_address,
            observation_layout=space_from_proto(info.observation_layout)
            if info.HasField("observation_layout")
            else None,
        )

    @property
    def action_dtype(self) -> type[np.generic]:
        """What actions travel as: float32 for Box, int64 for Discrete."""
        return np.int64 if isinstance(self.action_space, gym.spaces.Discrete) else np.float32


class EnvSession:
    """An open session: some instances of one env service, held until ``close``."""

    def __init__(self, stream: SessionStream, opened: environment_pb2.SessionOpened) -> None:
        self._stream = stream
        self.carrier = stream.kind
        self.session_id, self.incarnation = opened.session_id, opened.incarnation
        self.num_instances = opened.num_instances
        self.observations = tensors.decode(opened.observations)  # after reset

    def step(self, actions: np.ndarray) -> StepBatch:
        """Send the actions of every instance in one message; the env's answer, decoded."""
        self.send_step(actions)
        return self.receive_step()

    def send_step(self, actions: np.ndarray) -> None:
        """The first half of ``step``: a client of several sessions sends to all, then receives from all, so
        their env services step at the same time."""
        request = environment_pb2.StepRequest(session_id=self.session_id, actions=tensors.encode(actions))
        self._stream.send(environment_pb2.SessionRequest(step=request))

    def receive_step(self) -> StepBatch:
        return StepBatch.decode(self._stream.receive().step)

    def close(self, wait_s: float = 0.0) -> None:
        """End the session; the env service frees its instances (with ``wait_s``: waits that long at most for it
        to have done so, as a rollout handing the session's slot to another one does)."""
        self._stream.close(wait_s)


class EnvClient:
    """One env service at ``address``: ``transport`` 'auto' takes its local fast path when it is on this host
    (same network namespace), else gRPC; ``stop`` makes a local session's waits end, and ``answer_timeout_s``
    bounds them (None: a stopped env service is waited for; over gRPC, keepalive gives up within seconds)."""

    def __init__(
        self,
        address: str,
        transport: Transport = "auto",
        stop: threading.Event | None = None,
        answer_timeout_s: float | None = None,
    ) -> None:
        self.address, self.transport, self.answer_timeout_s = address, transport, answer_timeout_s
        self._stop = stop or threading.Event()
        self._channel = open_channel(address, CHANNEL_OPTIONS)
        self._stub = environment_pb2_grpc.EnvironmentStub(self._channel)
        self._info: environment_pb2.EnvironmentInfo | None = None

    def describe(self, timeout_s: float = 10.0) -> EnvDescription:
        self._info = self._stub.Describe(environment_pb2.DescribeRequest(), timeout=timeout_s)
        return EnvDescription.from_proto(self._info)

    def open(self, num_instances: int = 0, seed: int | None = None) -> EnvSession:
        """Claim ``num_instances`` (0: all free ones), reset with ``seed + i`` for instance i."""
        if self._info is None:
            self.describe()
        stream = open_stream(self._stub, self._info, self.transport, self._stop, self.answer_timeout_s)
        try:
            request = environment_pb2.OpenSession(num_instances=num_instances, seed=seed or 0)
            stream.send(environment_pb2.SessionRequest(open=request))
            return EnvSession(stream, stream.receive().opened)
        except BaseException:
            stream.close()
            raise

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EnvClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
