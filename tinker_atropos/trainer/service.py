"""The trainer service: the experience loop (``experience_loop``) of the configured algorithm as one process,
with the env's spaces read off a live env service, so that the trainer needs no simulator installed."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import grpc
import redis
import torch

from tinker_atropos import service_host
from tinker_atropos.config import Config
from tinker_atropos.device import resolve_device
from tinker_atropos.environment.client import EnvClient, EnvDescription
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.service_host import Endpoint
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.run_dir import RunFolderInUse, RunFolderOwner
from tinker_atropos.trainer.experience_loop import ExperienceLoop

log = logging.getLogger(__name__)


def describe_env(client: redis.Redis, run: str, stop: threading.Event) -> EnvDescription | None:
    """The spaces of the run's env, from the first env service of the registry that answers; None if stopped."""
    while not stop.is_set():
        try:
            records = live_services(client, run, "env")
        except redis.RedisError as error:
            log.warning("registry unreadable (%s); retrying", error)
            records = []
        for record in records:
            try:
                with EnvClient(record.address, "grpc") as env:
                    return env.describe(timeout_s=5)
            except grpc.RpcError as error:
                log.warning("cannot describe env service %s: %s", record.address, error.code())
        log.info("waiting for an environment service to register")
        stop.wait(1.0)
    return None


class TrainerService:
    """The experience loop, or the Atropos loop, and, when enabled, the Tinker API: front-ends of training in one
    process."""

    def __init__(self, config: Config, client: redis.Redis, run_dir: Path, incarnation: str) -> None:
        self.incarnation = incarnation
        # before anything is written there: RunFolderInUse (exit 2, one line) when it is another run's
        self.owner = RunFolderOwner(run_dir, "trainer", config.run.name)
        self.loop = (
            ExperienceLoop(config, client, run_dir, self.owner) if config.trainer.experience_loop else None
        )
        if self.loop is not None:
            self.loop.incarnation = incarnation
        self.tinker = None
        if config.trainer.tinker.enabled:  # imported only then: the SDK and FastAPI take half a second
            from tinker_atropos.frontends.tinker.server import TinkerAPI

            self.tinker = TinkerAPI(config, client, run_dir, resolve_device(config.trainer.device))
        self.atropos = None
        if config.trainer.atropos.enabled:
            from tinker_atropos.trainer.atropos_loop import AtroposLoop

            self.atropos = AtroposLoop(config, client, run_dir, resolve_device(config.trainer.device))

    def status(self) -> services_pb2.TrainerStatus:
        if self.loop:
            status = self.loop.status()
        elif self.atropos:
            status = self.atropos.status(self.incarnation)
        else:
            status = services_pb2.TrainerStatus(incarnation=self.incarnation)
        status.tinker_api = self.tinker.url if self.tinker else ""
        if self.tinker:  # the steps of Tinker clients' models it undid, beside the loop's updates
            status.updates_discarded_nonfinite += self.tinker.worker.guard.undone
        return status

    def add_to(self, server: grpc.Server) -> None:
        """No RPCs of its own besides health and status."""

    def run(self, stop: threading.Event) -> None:
        if self.tinker is not None:
            self.tinker.start(stop)
        try:
            if self.atropos is not None:
                self.atropos.run(stop)
                return
            if self.loop is None:
                stop.wait()
                return
            env = describe_env(self.loop.client, self.loop.run, stop)
            if env is None:
                return
            self.loop.setup(env)
            try:
                self.loop.train(stop)
            finally:  # also when it diverged: the parameters are the last finite ones
                try:
                    self.loop.checkpoint()
                except RunFolderInUse as error:
                    log.warning("no final checkpoint: %s", error)
                self.loop.close()
                with contextlib.suppress(redis.RedisError):  # Redis away: only these last counts are lost
                    self.loop.report_counters()
        finally:
            if self.tinker is not None:
                self.tinker.close()
            self.owner.close()


def serve(config: Config, redis_url: str, endpoint: Endpoint, run_dir: Path) -> None:
    """Run the trainer until SIGTERM/SIGINT, then checkpoint and exit."""

    def build(client: redis.Redis, incarnation: str) -> TrainerService:
        torch.set_num_threads(
            config.trainer.torch_threads
        )  # after limit_blas_threads: it may be the same BLAS
        return TrainerService(config, client, run_dir, incarnation)

    service_host.serve("trainer", config, redis_url, endpoint, build)
