"""The env service's local fast path: the sessions of ``Environment.Session`` over a Unix socket, for a
rollout on the same host. One thread per connection runs the very same session code as the gRPC stream; a
malformed frame or request ends that connection with a status frame, never the service."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from tinker_atropos.logs import CountedWarnings
from tinker_atropos.protocol import local_stream
from tinker_atropos.protocol.v1 import environment_pb2

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class SessionAborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class LocalStreamControl:
    """A connection's ``StreamControl``: its peer is the connecting process, as the kernel reports it."""

    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection
        try:
            pid, uid, _ = _PEERCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            self.peer, self.uid = f"unix:pid={pid},uid={uid}", uid
        except OSError:
            self.peer, self.uid = "unix:unknown", None

    def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        raise SessionAborted(code, message)

    def cancel(self) -> None:
        with contextlib.suppress(OSError):  # already closed
            self._connection.shutdown(socket.SHUT_RDWR)


# The servicer's ``serve_stream``: serialized SessionRequests in, responses out.
SessionHandler = Callable[
    [Iterator[bytes | bytearray], LocalStreamControl], Iterator[environment_pb2.SessionResponse]
]


class LocalSessionServer:
    """Listens on the abstract Unix socket ``name`` and serves each connection as one session.

    An abstract socket has no file permissions: any process of the host's network namespace can connect. So the
    kernel's peer credentials (SO_PEERCRED, unforgeable) must show the service's own user, or the connection is
    refused with UNAUTHENTICATED and counted. Another user, or another container, steps the envs over gRPC.
    """

    def __init__(self, session: SessionHandler, name: str) -> None:
        self.session = session
        self.address = local_stream.local_address(name)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(local_stream.socket_name(self.address))
        self.listener.listen(64)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._acceptor = threading.Thread(target=self._accept_loop, name="local-accept", daemon=True)
        self.uid = os.getuid()
        self.peers_refused = 0
        self.refusals = CountedWarnings("local socket connections refused")

    def start(self) -> None:
        self._acceptor.start()

    def stop(self) -> None:
        """Stop accepting and end every open connection; their sessions release their instances. Idempotent."""
        if self.listener.fileno() == -1:
            return
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):  # already closed by its peer
                    connection.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # the listener was shut down
            with self._lock:
                self._connections.add(connection)
            threading.Thread(
                target=self._serve, args=(connection,), name="local-session", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        def requests() -> Iterator[bytearray]:  # a FrameError raised here is the servicer's to answer
            while (payload := local_stream.receive_payload(connection)) is not None:
                yield payload

        control = LocalStreamControl(connection)
        try:
            if control.uid != self.uid:
                self.peers_refused += 1
                self.refusals.add(
                    f"uid {control.uid}", f"{control.peer} (this service runs as uid {self.uid})"
                )
                self._send_status(
                    connection,
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the local socket serves only processes of uid {self.uid}, the service's user; "
                    "connect over gRPC",
                )
                return
            try:
                with contextlib.closing(self.session(requests(), control)) as responses:
                    for response in responses:
                        local_stream.send(connection, environment_pb2.LocalFrame(response=response))
            except OSError:
                raise  # the socket itself failed: no status can reach the peer
            except SessionAborted as error:
                self._send_status(connection, error.code, error.message)
            except Exception as error:  # a bug or a crashed env: what grpcio answers with UNKNOWN
                log.exception("local session failed")
                self._send_status(connection, grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
        except OSError as error:  # the peer went away mid-frame: its session is already released
            log.info("local session connection lost: %s", error)
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    @staticmethod
    def _send_status(connection: socket.socket, code: grpc.StatusCode, message: str) -> None:
        status = environment_pb2.LocalStatus(code=code.name, message=message)
        local_stream.send(connection, environment_pb2.LocalFrame(status=status))
