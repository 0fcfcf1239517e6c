"""The Tinker API (``frontends/tinker``) as a driver: its HTTP server and worker serve until the trainer stops."""

from __future__ import annotations

import threading
from pathlib import Path

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.frontends.tinker.server import TinkerAPI
from tinker_atropos.protocol.v1 import services_pb2


class TinkerDriver:
    def __init__(self, config: Config, client: redis.Redis, run_dir: Path, device: torch.device) -> None:
        self.api = TinkerAPI(config, client, run_dir, device)

    def run(self, stop: threading.Event) -> None:
        self.api.start(stop)
        stop.wait()

    def status(self) -> services_pb2.TrainerStatus:
        """Where it serves, the steps of Tinker clients' models it undid, and what it refused or expired."""
        return services_pb2.TrainerStatus(tinker_api=self.api.url, updates_discarded_nonfinite=self.api.worker.guard.undone,
                                          tinker_events=self.api.events())  # fmt: skip

    def close(self) -> None:
        self.api.close()
