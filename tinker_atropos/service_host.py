"""What every service process shares (``serve``): its gRPC server with the standard health service and the
status RPC, its registry entry, its incarnation id, and a SIGTERM that drains instead of killing."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import redis
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tinker_atropos.config import Config
from tinker_atropos.logs import configure_logging
from tinker_atropos.processes import limit_blas_threads, local_host_id, stop_on_signals
from tinker_atropos.protocol.v1 import services_pb2, services_pb2_grpc
from tinker_atropos.state.connection import connect_when_reachable
from tinker_atropos.state.registry import Registration

log = logging.getLogger(__name__)


# Clients ping every few seconds to notice a stopped or unreachable peer, also while a paused stream carries
# no data; by default a server answers such pings with GOAWAY ("too many pings") and breaks the stream.
# Servers ping too: a client cut off by the network (or whose machine died) never closes its streams, and an
# env session held by it would keep its instances claimed for good, also after the link is back.
# What a server accepts in one message: its requests are actions, a session's opening or a status query, a few
# KiB; a client cannot make it hold more (over the bound: RESOURCE_EXHAUSTED for that call, the rest served).
MAX_REQUEST_BYTES = 16 * 1024 * 1024


SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
]


def new_incarnation() -> str:
    """Random per process start: lets peers tell a restarted service from the one they knew."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Endpoint:
    """Where a service listens and how others reach it: containers bind 0.0.0.0 and advertise the pod or
    node address; ``name`` identifies the service across restarts (counted in the registry)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    name: str | None = None
    metrics_port: int | None = None  # Prometheus metrics on this port (0: a free one); None: not served

    def advertised(self, port: int) -> str:
        host = self.advertise_host
        if not host:
            host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"{host}:{port}"


class Service(Protocol):
    """What one service process runs, whatever its kind: its RPCs on the shared gRPC server, its status (served
    by ``Status.GetStatus`` and written to the registry with each heartbeat), and its loop."""

    def status(self) -> Message:
        """Its status message: EnvironmentStatus, RolloutStatus or TrainerStatus."""
        ...

    def add_to(self, server: grpc.Server) -> None:
        """Register its own RPCs (if any) on ``server``."""
        ...

    def run(self, stop: threading.Event) -> None:
        """Work until ``stop`` is set, then finish the step in flight."""
        ...


class _StatusServicer(services_pb2_grpc.StatusServicer):
    def __init__(self, kind: str, status: Callable[[], Message]) -> None:
        self._field, self._status = _STATUS_FIELDS[kind], status

    def GetStatus(self, request, context) -> services_pb2.ServiceStatus:  # noqa: N802 - gRPC name
        return services_pb2.ServiceStatus(**{self._field: self._status()})


# eval_env: an env service that only the trainer's periodic evaluation uses (``env --role eval``)
_STATUS_FIELDS = {
    "env": "environment",
    "eval_env": "environment",
    "rollout": "rollout",
    "trainer": "trainer",
    "atropos_api": "atropos_api",
}


class ServiceHost:
    """A service's gRPC server (health and status included), and its registry entry, started and stopped
    together."""

    def __init__(
        self,
        kind: str,
        config: Config,
        client: redis.Redis,
        endpoint: Endpoint,
        status: Callable[[], Message],
        incarnation: str,
        max_workers: int = 16,
    ) -> None:
        from tinker_atropos.prometheus import CallCounter
        from tinker_atropos.security import TokenCheck, server_credentials, service_token

        self.kind, self.incarnation, self.endpoint = kind, incarnation, endpoint
        self._status, self.run = status, config.run.name
        token = service_token()
        self.token_check = TokenCheck(token) if token else None
        self.calls = CallCounter()
        interceptors = [self.calls, *([self.token_check] if self.token_check else [])]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            options=SERVER_OPTIONS,
            interceptors=interceptors,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services_pb2_grpc.add_StatusServicer_to_server(_StatusServicer(kind, status), self.server)
        bind, credentials = f"{endpoint.host}:{endpoint.port}", server_credentials()
        self.tls = credentials is not None
        self.port = (
            self.server.add_secure_port(bind, credentials)
            if credentials
            else self.server.add_insecure_port(bind)
        )
        if self.port == 0:
            raise RuntimeError(f"cannot bind the {kind} service to {endpoint.host}:{endpoint.port}")
        self.address = endpoint.advertised(self.port)
        self.metrics_server: Any = None
        self.metrics_address = ""
        self.registration = Registration(
            client,
            config.run.name,
            kind,
            self.address,
            self.incarnation,
            self.figures,
            config.redis.heartbeat_interval_s,
            config.redis.heartbeat_ttl_s,
            endpoint.name,
            local_host_id(),
        )

    def calls_refused(self) -> int:
        """Calls refused for want of the run's token."""
        return self.token_check.refused if self.token_check else 0

    def figures(self) -> dict[str, Any]:
        """What the registry entry and the Prometheus metrics say of this service."""
        return {
            **status_figures(self._status()),
            "calls_refused": self.calls_refused(),
            "metrics_address": self.metrics_address,
        }

    def start(self) -> None:
        if self.endpoint.metrics_port is not None:  # before the registration: its first entry names it
            from tinker_atropos.prometheus import ServiceCollector, serve_metrics

            collector = ServiceCollector(self.kind, self.run, self.figures, self.calls)
            self.metrics_server = serve_metrics(self.endpoint.host, self.endpoint.metrics_port, collector)
            self.metrics_address = self.endpoint.advertised(self.metrics_server.server_port)
            log.info("Prometheus metrics on http://%s/metrics", self.metrics_address)
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.registration.start()
        log.info(
            "%s service %s serving on %s (%s, %s)",
            self.kind,
            self.incarnation,
            self.address,
            "TLS" if self.tls else "plaintext",
            "token" if self.token_check else "no token",
        )

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.registration.close()
        self.server.stop(grace_s).wait()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        log.info("%s service %s stopped", self.kind, self.incarnation)


def serve(
    kind: str,
    config: Config,
    redis_url: str,
    endpoint: Endpoint,
    build: Callable[[redis.Redis, str], Service],
    max_workers: int = 16,
) -> None:
    """Run one service process until SIGTERM/SIGINT: Redis once it answers, ``build(client, incarnation)``,
    the gRPC server and the registry entry, the service's loop, then a drain."""
    configure_logging(kind)
    limit_blas_threads()
    stop = stop_on_signals()
    client = connect_when_reachable(redis_url, config.redis.unreachable_timeout_s, stop)
    if client is None:
        return
    incarnation = new_incarnation()
    service = build(client, incarnation)
    host = ServiceHost(kind, config, client, endpoint, service.status, incarnation, max_workers)
    service.add_to(host.server)
    host.start()
    try:
        service.run(stop)
    finally:
        host.stop()


def status_figures(status: Message) -> dict[str, Any]:
    """A status message as plain JSON-able values for the registry (numbers stay numbers, unlike the
    canonical JSON mapping that writes 64-bit integers as strings)."""
    figures: dict[str, Any] = {}
    for field in status.DESCRIPTOR.fields:
        value = getattr(status, field.name)
        figures[field.name] = dict(value) if field.message_type is not None else value
    return figures


def check_health(address: str, timeout_s: float = 3.0) -> bool:
    """True when the gRPC health service at ``address`` reports SERVING (over TLS when this process's
    channels use it, ``security.open_channel``)."""
    from tinker_atropos.security import open_channel

    with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
