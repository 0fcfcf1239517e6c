"""The trajectory API as a service of the run (``tinker-atropos atropos-api``): its HTTP server for environments
and trainers, and, like every other service, a gRPC port for health and status and a registry entry."""

from __future__ import annotations

import logging
import socket
import threading

import redis

from tinker_atropos.config import Config
from tinker_atropos.frontends.atropos.app import build_app
from tinker_atropos.frontends.atropos.store import TrajectoryStore
from tinker_atropos.frontends.http import BackgroundServer, endpoint_keys
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.service_host import Endpoint
from tinker_atropos.service_host import serve as serve_service

log = logging.getLogger(__name__)


class AtroposAPI:
    """A ``service_host.Service``: its HTTP server in a thread until the stop event."""

    def __init__(
        self,
        config: Config,
        client: redis.Redis,
        incarnation: str,
        endpoint: Endpoint,
        http_fd: int | None = None,
    ) -> None:
        section = config.atropos
        self.incarnation, self.endpoint = incarnation, endpoint
        self.store = TrajectoryStore(
            client, config.run.name, section.max_queue_sequences, section.dedup_window
        )
        keys = endpoint_keys(
            "atropos-api", section.api_keys_file, "atropos.api_keys_file", "Atropos trajectory API"
        )
        self.open = not keys
        app = build_app(self.store, keys, int(section.max_request_mb * 2**20))
        # a listening socket inherited from ``up``: while this process restarts, environments' connections wait in
        # its backlog instead of being refused
        sock = socket.socket(fileno=http_fd) if http_fd is not None else None
        self.http = BackgroundServer(app, section.host, section.port, "Atropos trajectory API", sock)

    @property
    def url(self) -> str:
        """Its URL as others reach it: the HTTP port on the service's advertised host (as its gRPC address)."""
        if not self.http.url:
            return ""
        port = int(self.http.url.rsplit(":", 1)[1])
        where = Endpoint(host=self.http.server.config.host, advertise_host=self.endpoint.advertise_host)
        return f"{self.http.scheme}://{where.advertised(port)}"

    def status(self) -> services_pb2.AtroposApiStatus:
        return services_pb2.AtroposApiStatus(
            incarnation=self.incarnation, url=self.url, **self.store.figures()
        )

    def add_to(self, server: object) -> None:
        """No RPC of its own: its API is HTTP."""

    def run(self, stop: threading.Event) -> None:
        if self.open:  # said before it answers anyone
            log.warning(
                "the Atropos trajectory API takes no API key (--insecure): anyone who reaches it can post "
                "groups and reset its data"
            )
        self.http.start(stop)
        log.info("Atropos trajectory API at %s (state in Redis, %s)", self.url, self.store.prefix)
        stop.wait()
        self.http.close()


def serve(config: Config, redis_url: str, endpoint: Endpoint, http_fd: int | None = None) -> None:
    serve_service(
        "atropos_api",
        config,
        redis_url,
        endpoint,
        lambda client, incarnation: AtroposAPI(config, client, incarnation, endpoint, http_fd),
    )
