"""The client-side carriers of an env session: the gRPC ``Session`` stream, and the local fast path (a Unix socket
in the abstract namespace) that an env service offers to rollouts on its own host.

Both carry the same SessionRequest/SessionResponse sequence and fail the same way (an ``grpc.RpcError``
with a status code), so the session loop and its reconnect logic do not know which one they use.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
from typing import Protocol

import grpc

from tinker_atropos.config import Transport
from tinker_atropos.protocol import local_stream
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc

log = logging.getLogger(__name__)

STOP_POLL_S = 1.0


class SessionStream(Protocol):
    kind: str

    def send(self, request: environment_pb2.SessionRequest) -> None: ...
    def receive(self) -> environment_pb2.SessionResponse: ...
    def close(self, wait_s: float = 0.0) -> None: ...


class LocalStreamError(grpc.RpcError):
    """A local session ended with a status, or its socket broke: the codes gRPC would have used."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class GrpcSessionStream:
    """``Environment.Session``: requests go through a queue that gRPC's sender thread drains."""

    kind = "grpc"

    def __init__(self, stub: environment_pb2_grpc.EnvironmentStub) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stub.Session(iter(self._requests.get, None))

    def send(self, request: environment_pb2.SessionRequest) -> None:
        self._requests.put(request)

    def receive(self) -> environment_pb2.SessionResponse:
        return next(self._responses)

    def close(self, wait_s: float = 0.0) -> None:
        self._requests.put(None)  # half-close: the env service frees the session's instances
        if wait_s:  # and ends the call once it has
            ended = threading.Event()
            self._responses.add_done_callback(lambda _: ended.set())
            ended.wait(wait_s)
        self._responses.cancel()


class LocalSessionStream:
    """The local fast path: one frame each way per step, written and read by the session's own thread."""

    kind = "local"

    def __init__(self, address: str, stop: threading.Event, answer_timeout_s: float | None = None) -> None:
        self._stop, self._answer_timeout_s = stop, answer_timeout_s
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(local_stream.socket_name(address))
        except OSError:
            self._socket.close()
            raise

    def send(self, request: environment_pb2.SessionRequest) -> None:
        try:
            local_stream.send(self._socket, request)
        except OSError as error:
            # A service that refuses us writes its reason, then closes: a send racing that close breaks the
            # pipe, and the reason waits in our receive buffer. Say it rather than "broken pipe".
            if select.select([self._socket], [], [], 0)[0]:
                self.receive()
            raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"local stream broken: {error}") from error

    def receive(self) -> environment_pb2.SessionResponse:
        # The kernel closes the socket when the env process dies; a stopped (SIGSTOP) env is waited for, its
        # session resumes where it was, unless ``answer_timeout_s`` bounds the wait. Wake up now and then to
        # honour our own stop.
        waited = 0.0
        while not select.select([self._socket], [], [], STOP_POLL_S)[0]:
            if self._stop.is_set():
                raise LocalStreamError(grpc.StatusCode.CANCELLED, "the rollout is stopping")
            waited += STOP_POLL_S
            if self._answer_timeout_s is not None and waited >= self._answer_timeout_s:
                raise LocalStreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the env service did not answer in {waited:g} s"
                )
        try:
            frame = local_stream.receive(self._socket, environment_pb2.LocalFrame)
        except (OSError, local_stream.FrameError) as error:
            raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"local stream broken: {error}") from error
        if frame is None:
            raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, "the env service closed the local stream")
        if frame.WhichOneof("kind") == "status":
            code = grpc.StatusCode.__members__.get(frame.status.code, grpc.StatusCode.UNKNOWN)
            raise LocalStreamError(code, frame.status.message)
        return frame.response

    def close(self, wait_s: float = 0.0) -> None:
        """The env service sees the end of the stream and frees the instances; with ``wait_s``, until it closes
        its end, which it does once they are free."""
        if wait_s:
            with contextlib.suppress(OSError):  # a timeout, or a socket already broken
                self._socket.shutdown(socket.SHUT_WR)
                self._socket.settimeout(wait_s)
                while self._socket.recv(1 << 16):
                    pass
        self._socket.close()


def open_stream(
    stub: environment_pb2_grpc.EnvironmentStub,
    info: environment_pb2.EnvironmentInfo,
    transport: Transport,
    stop: threading.Event,
    answer_timeout_s: float | None = None,
) -> SessionStream:
    """The local fast path when allowed and reachable (same host and network namespace), else gRPC."""
    if transport == "auto" and info.local_address:
        try:
            return LocalSessionStream(info.local_address, stop, answer_timeout_s)
        except (OSError, ValueError) as error:
            log.info("local stream %s not reachable (%s): using gRPC", info.local_address, error)
    return GrpcSessionStream(stub)
