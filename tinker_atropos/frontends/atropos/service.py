"""The trajectory API as a service of the run (``tinker-atropos atropos-api``): its HTTP server for environments
and trainers, and, like every other service, a gRPC port for health and status and a registry entry."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import redis
import uvicorn

from tinker_atropos.config import Config
from tinker_atropos.frontends.atropos.app import build_app
from tinker_atropos.frontends.atropos.store import TrajectoryStore
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.runtime import Endpoint, FatalError
from tinker_atropos.runtime import serve as serve_service

log = logging.getLogger(__name__)


def api_keys(path: str | None) -> list[str]:
    """The allowed keys of ``atropos.api_keys_file`` (none asked without one); FatalError for a file that is
    missing or empty, since it was set to protect the API."""
    if path is None:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise FatalError(f"atropos.api_keys_file {path}: {error.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise FatalError(f"atropos.api_keys_file {path} holds no key: nobody could use the trajectory API")
    return keys


class AtroposAPI:
    """A ``runtime.Service``: uvicorn in a thread until the stop event."""

    def __init__(self, config: Config, client: redis.Redis, incarnation: str) -> None:
        section = config.atropos
        self.incarnation = incarnation
        self.store = TrajectoryStore(
            client, config.run.name, section.max_queue_sequences, section.dedup_window
        )
        app = build_app(self.store, api_keys(section.api_keys_file), int(section.max_request_mb * 2**20))
        cert, key = os.environ.get("TA_TLS_CERT"), os.environ.get("TA_TLS_KEY")
        tls = {"ssl_certfile": cert, "ssl_keyfile": key} if cert and key else {}
        self.scheme = "https" if tls else "http"
        self.server = uvicorn.Server(uvicorn.Config(app, host=section.host, port=section.port, log_level="warning",
                                                    lifespan="off", access_log=False, timeout_graceful_shutdown=2, **tls))  # fmt: skip
        self.url = ""  # once bound

    def status(self) -> services_pb2.AtroposApiStatus:
        return services_pb2.AtroposApiStatus(
            incarnation=self.incarnation, url=self.url, **self.store.figures()
        )

    def add_to(self, server: object) -> None:
        """No RPC of its own: its API is HTTP."""

    def run(self, stop: threading.Event) -> None:
        thread = threading.Thread(target=self.server.run, name="atropos-http", daemon=True)
        thread.start()
        while not self.server.started and thread.is_alive() and not stop.is_set():
            stop.wait(0.05)
        if not self.server.started and not stop.is_set():
            config = self.server.config
            raise FatalError(f"the Atropos trajectory API could not bind {config.host}:{config.port}")
        if self.server.started:
            host, port = self.server.servers[0].sockets[0].getsockname()[:2]
            self.url = f"{self.scheme}://{host}:{port}"
            log.info("Atropos trajectory API at %s (state in Redis, %s)", self.url, self.store.prefix)
        stop.wait()
        self.server.should_exit = True
        thread.join(timeout=10)


def serve(config: Config, redis_url: str, endpoint: Endpoint) -> None:
    serve_service(
        "atropos_api",
        config,
        redis_url,
        endpoint,
        lambda client, incarnation: AtroposAPI(config, client, incarnation),
    )
