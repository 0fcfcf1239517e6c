"""The environment service: hosts instances of one env and steps them over one bidi stream per session.

A session claims some of the service's instances for as long as its stream lives. Careless or hostile clients
harm only their own stream: a malformed request ends it (INVALID_ARGUMENT, a warning naming the peer, at most
one every 10 s per peer and reason with the count, no traceback), a stream that does not open in time or an open session that goes quiet is ended and its
instances freed, and past ``env.session_limit`` streams a new one is refused (RESOURCE_EXHAUSTED). A session whose
client has sent nothing for longer than the rollouts' lease TTL gives its instances up to a new session that needs
them: its rollout stopped (SIGSTOP, a stalled host) and lost its lease to the rollout now asking. Streams never
take the last gRPC workers, so Describe and the health checks are always answered. The same session logic
serves the gRPC stream and the local fast path for co-located rollouts (``local_server``); the streams' admission,
watchdog and takeover are ``stream_watch.py``'s, the sessions and the instances they hold ``env_sessions.py``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from tinker_atropos import service_host
from tinker_atropos.config import Config, EnvSection
from tinker_atropos.environment.check import check_env
from tinker_atropos.environment.env_sessions import EnvSessions
from tinker_atropos.environment.envs import EnvSpaces
from tinker_atropos.environment.local_server import LocalSessionServer
from tinker_atropos.environment.spaces import space_to_proto
from tinker_atropos.environment.stream_watch import StreamControl, StreamWatch
from tinker_atropos.logs import peer_host
from tinker_atropos.protocol import local_stream
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc, services_pb2
from tinker_atropos.service_host import Endpoint

log = logging.getLogger(__name__)

RESERVED_WORKERS = 4  # gRPC workers no stream can take: Describe and health are served past the session limit


class GrpcStreamControl:
    def __init__(self, context: grpc.ServicerContext) -> None:
        self.peer, self._context = context.peer(), context

    def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        self._context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    def cancel(self) -> None:
        self._context.cancel()


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    """``takeover_after_s``: how long a session's client may send nothing before a new session that needs its
    instances takes them (the rollouts' ``lease_ttl_s``: by then a stopped rollout's lease is another's)."""

    def __init__(self, env: EnvSection, spaces: EnvSpaces, takeover_after_s: float) -> None:
        self.env = env
        self.observation_space, self.action_space = spaces.observation_space, spaces.action_space
        self.observation_layout = spaces.observation_layout
        self.incarnation = ""
        self.local_address = ""
        self.watch = StreamWatch(env, threading.Lock(), takeover_after_s)
        self.sessions = EnvSessions(env, self.action_space, self.watch, self.refuse)
        self.bad_requests = 0
        self.streams_refused = 0

    def status(self) -> services_pb2.EnvironmentStatus:
        sessions = self.sessions
        return services_pb2.EnvironmentStatus(
            incarnation=self.incarnation,
            env_id=self.env.id,
            instances=sessions.capacity,
            free_instances=sessions.free_instances,
            sessions=len(sessions.held),
            streams=len(self.watch.streams),
            steps=sessions.steps,
            episodes=sessions.episodes,
            episodes_cut_nonfinite=sessions.cut_nonfinite.total(),
            bad_requests=self.bad_requests,
            streams_refused=self.streams_refused,
            streams_timed_out=self.watch.timed_out,
            sessions_refused_busy=sessions.refused_busy,
            sessions_taken_over=self.watch.taken_over,
        )

    def start(self) -> None:
        self.watch.start()

    def close(self) -> None:
        """End every stream (their sessions free their instances) and stop watching."""
        self.watch.close()

    def Describe(self, request, context) -> environment_pb2.EnvironmentInfo:  # noqa: N802 - gRPC name
        return environment_pb2.EnvironmentInfo(
            env_id=self.env.id,
            observation_space=space_to_proto(self.observation_space),
            action_space=space_to_proto(self.action_space),
            num_instances=self.sessions.capacity,
            free_instances=self.sessions.free_instances,
            incarnation=self.incarnation,
            backend=self.env.backend,
            local_address=self.local_address,
            observation_layout=None
            if self.observation_layout is None
            else space_to_proto(self.observation_layout),
        )

    def Session(  # noqa: N802 - gRPC name
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[environment_pb2.SessionResponse]:
        """Requests arrive as bytes (see ``add_to_server``): one that does not parse is this stream's fault,
        answered with INVALID_ARGUMENT, where grpcio's own deserializer would log a traceback."""
        return self.serve_stream(request_iterator, GrpcStreamControl(context))

    def serve_stream(
        self, raw: Iterator[bytes | bytearray], control: StreamControl
    ) -> Iterator[environment_pb2.SessionResponse]:
        """A session over any carrier that hands over serialized SessionRequests."""
        return self.session(self._parsed(raw, control), control)

    def _parsed(
        self, raw: Iterator[bytes | bytearray], control: StreamControl
    ) -> Iterator[environment_pb2.SessionRequest]:
        try:
            for data in raw:
                try:
                    yield environment_pb2.SessionRequest.FromString(data)
                except DecodeError as error:
                    self.refuse(control, grpc.StatusCode.INVALID_ARGUMENT, f"not a SessionRequest: {error}")
        except grpc.RpcError:
            return  # the stream was cancelled (by its client, the watchdog or a drain)
        except local_stream.FrameError as error:
            self.refuse(control, grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def refuse(self, control: StreamControl, code: grpc.StatusCode, message: str) -> NoReturn:
        """End a stream for what its client did: a warning with the peer (rate-limited), no traceback."""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            self.bad_requests += 1
        self.watch.ended.add(f"{code.name} from {peer_host(control.peer)}", message)
        control.abort(code, message)

    def session(
        self, requests: Iterator[environment_pb2.SessionRequest], control: StreamControl
    ) -> Iterator[environment_pb2.SessionResponse]:
        """One session, whatever carries it."""
        admitted = self.watch.admit(control)
        if admitted is None:
            self.streams_refused += 1
            self.refuse(
                control,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.env.session_limit} streams already open, the limit of this env service "
                "(env.max_sessions)",
            )
        stream_id, stream = admitted
        try:
            yield from self.sessions.serve(requests, control, stream, self.incarnation)
        finally:
            self.watch.remove(stream_id)


def add_to_server(servicer: EnvironmentServicer, server: grpc.Server) -> None:
    """Register the Environment service as the generated stub would, except that Session requests reach the
    servicer as bytes and are parsed there."""
    name = "tinker_atropos.v1.Environment"
    handlers = {
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=environment_pb2.DescribeRequest.FromString,
            response_serializer=environment_pb2.EnvironmentInfo.SerializeToString,
        ),
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session, response_serializer=environment_pb2.SessionResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class EnvService:
    """The env service process: the servicer on gRPC and on the local socket, until stopped."""

    def __init__(self, config: Config, spaces: EnvSpaces, incarnation: str) -> None:
        self.servicer = EnvironmentServicer(config.env, spaces, config.rollout.lease_ttl_s)
        self.servicer.incarnation = incarnation
        try:  # the incarnation makes the name unique on the host (a run name could overflow the 107-byte limit)
            self.local = LocalSessionServer(self.servicer.serve_stream, f"tinker-atropos/env/{incarnation}")
            self.servicer.local_address = self.local.address
        except OSError as error:  # no abstract Unix sockets (not Linux): rollouts use gRPC
            log.warning("no local fast path: %s", error)
            self.local = None

    def status(self) -> services_pb2.EnvironmentStatus:
        status = self.servicer.status()
        status.local_peers_refused = self.local.peers_refused if self.local is not None else 0
        return status

    def add_to(self, server: grpc.Server) -> None:
        add_to_server(self.servicer, server)

    def run(self, stop: threading.Event) -> None:
        if self.local is not None:
            self.local.start()
        self.servicer.start()
        # A timed wait: the kernel may hand SIGTERM to any thread (it does right after a SIGCONT), and then only a
        # main thread that wakes up by itself runs the Python handler. An untimed wait ignored SIGTERM for good.
        while not stop.wait(0.5):
            pass
        self.servicer.close()
        if self.local is not None:
            self.local.stop()


def serve(config: Config, redis_url: str, endpoint: Endpoint, role: str = "train") -> None:
    """Run one environment service until SIGTERM/SIGINT; EnvError, before anything starts, for an env that
    cannot be served. ``role`` eval registers it as the run's evaluation env service (kind ``eval_env``),
    which rollouts do not see and the trainer's periodic evaluation plays on."""
    spaces = check_env(config.env)
    service_host.serve(
        "eval_env" if role == "eval" else "env",
        config,
        redis_url,
        endpoint,
        lambda _client, incarnation: EnvService(config, spaces, incarnation),
        max_workers=config.env.session_limit + RESERVED_WORKERS,
    )
