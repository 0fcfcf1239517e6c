"""The trainer service: the drivers the config enables (``driver.py``) as one process: the experience loop of the
configured algorithm (the env's spaces read off a live env service, so that the trainer needs no simulator
installed) or the Atropos loop, and the Tinker API beside either or alone."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import redis
import torch

from tinker_atropos import service_host
from tinker_atropos.config import Config
from tinker_atropos.device import resolve_device
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.service_host import Endpoint
from tinker_atropos.state.run_dir import RunFolderOwner
from tinker_atropos.trainer.driver import Driver
from tinker_atropos.trainer.experience_loop import ExperienceLoop

log = logging.getLogger(__name__)


def build_drivers(config: Config, client: redis.Redis, run_dir: Path, owner: RunFolderOwner) -> list[Driver]:
    """The drivers ``trainer`` enables; they are closed last to first, so the Tinker API serves until the loops
    have written their last checkpoints. The Tinker API and the Atropos loop are imported only when enabled: the
    SDK and FastAPI take half a second."""
    trainer, drivers = config.trainer, []
    if trainer.tinker.enabled:
        from tinker_atropos.trainer.tinker.driver import TinkerAPI

        drivers.append(TinkerAPI(config, client, run_dir, resolve_device(trainer.device)))
    if trainer.atropos.enabled:
        from tinker_atropos.trainer.atropos_loop import AtroposLoop

        drivers.append(AtroposLoop(config, client, run_dir, resolve_device(trainer.device)))
    if trainer.experience_loop:
        drivers.append(ExperienceLoop(config, client, run_dir, owner))
    return drivers


class TrainerService:
    def __init__(self, config: Config, client: redis.Redis, run_dir: Path, incarnation: str) -> None:
        self.incarnation = incarnation
        # before anything is written there: RunFolderInUse (exit 2, one line) when it is another run's
        self.owner = RunFolderOwner(run_dir, "trainer", config.run.name)
        self.drivers = build_drivers(config, client, run_dir, self.owner)

    def status(self) -> services_pb2.TrainerStatus:
        """The drivers' parts in one; the updates each undid add up."""
        status = services_pb2.TrainerStatus(incarnation=self.incarnation)
        for driver in self.drivers:
            part = driver.status()
            undone = status.updates_discarded_nonfinite + part.updates_discarded_nonfinite
            status.MergeFrom(part)
            status.updates_discarded_nonfinite = undone
        return status

    def add_to(self, server: grpc.Server) -> None:
        """No RPCs of its own besides health and status."""

    def run(self, stop: threading.Event) -> None:
        """Every driver in a thread of its own until one ends (SIGTERM ends them all), then all of them closed,
        last to first, and the first error raised; with no driver, until SIGTERM. This thread only waits, waking
        every second: the kernel may hand a SIGTERM to any thread, and its handler runs in this one."""
        with ThreadPoolExecutor(max(len(self.drivers), 1), thread_name_prefix="driver") as pool:
            runs = [pool.submit(_run_until_one_ends, driver, stop) for driver in self.drivers]
            runs = runs or [pool.submit(stop.wait)]
            try:
                while futures.wait(runs, timeout=1.0).not_done:
                    pass
                for run in runs:
                    run.result()
            finally:
                try:
                    for driver in reversed(self.drivers):
                        driver.close()
                finally:
                    self.owner.close()


def _run_until_one_ends(driver: Driver, stop: threading.Event) -> None:
    try:
        driver.run(stop)
    finally:
        stop.set()


def serve(config: Config, redis_url: str, endpoint: Endpoint, run_dir: Path) -> None:
    """Run the trainer until SIGTERM/SIGINT, then checkpoint and exit."""

    def build(client: redis.Redis, incarnation: str) -> TrainerService:
        torch.set_num_threads(
            config.trainer.torch_threads
        )  # after limit_blas_threads: it may be the same BLAS
        return TrainerService(config, client, run_dir, incarnation)

    service_host.serve("trainer", config, redis_url, endpoint, build)
