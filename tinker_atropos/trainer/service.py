"""The trainer service: the drivers the config enables (``driver.py``) as one process: the experience loop of the
configured algorithm (the env's spaces read off a live env service, so that the trainer needs no simulator
installed) or the Atropos loop, and the Tinker API beside either or alone; one TensorBoard log (``tensorboard.py``)
for all of them, closed after the last."""

from __future__ import annotations

import logging
import threading
from collections import Counter
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
from tinker_atropos.trainer.checkpointing import Checkpointer
from tinker_atropos.trainer.experience_loop import ExperienceLoop
from tinker_atropos.trainer.figures import write_figures
from tinker_atropos.trainer.tensorboard import TensorBoardLog, run_log
from tinker_atropos.training.driver import Driver

log = logging.getLogger(__name__)

# between two looks at the checkpointers (and at the drivers' threads): a step is kept within it
CHECK_S = 0.1


def build_drivers(
    config: Config,
    client: redis.Redis,
    run_dir: Path,
    owner: RunFolderOwner,
    tensorboard: TensorBoardLog | None,
) -> list[tuple[Driver, Path | None, str | None]]:
    """The drivers ``trainer`` enables, each with the folder of its checkpoints (None: it keeps its state its own
    way) and the name of the single file an earlier version of it checkpointed to; they are closed last to first,
    so the Tinker API serves until the loops have written their last checkpoints. ``owner`` checks the run folder
    before the Tinker API's own writes; each writes its curves to ``tensorboard``. The Tinker API and the Atropos
    loop are imported only when enabled: the SDK and FastAPI take half a second."""
    trainer, drivers = config.trainer, []
    if trainer.tinker.enabled:
        from tinker_atropos.tinker_api.service import TinkerAPI

        steps = tensorboard.add_step if tensorboard is not None else None
        tinker = TinkerAPI(config, client, run_dir, resolve_device(trainer.device), owner, steps)
        drivers.append((tinker, None, None))  # a snapshot per state-changing request (tinker_api/engine)
    if trainer.atropos.enabled:
        from tinker_atropos.trainer.atropos_loop import EARLIER_STATE, AtroposLoop

        atropos = AtroposLoop(config, client, run_dir, resolve_device(trainer.device), tensorboard)
        drivers.append((atropos, atropos.folder, EARLIER_STATE))
    if trainer.experience_loop:
        loop = ExperienceLoop(config, client, run_dir, tensorboard)
        drivers.append((loop, loop.folder, None))
    return drivers


class TrainerService:
    def __init__(self, config: Config, client: redis.Redis, run_dir: Path, incarnation: str) -> None:
        self.incarnation = incarnation
        # before anything is written there: RunFolderInUse (exit 2, one line) when it is another run's
        self.owner = RunFolderOwner(run_dir, "trainer", config.run.name)
        self.tensorboard = run_log(config, client, run_dir)
        built = build_drivers(config, client, run_dir, self.owner, self.tensorboard)
        self.drivers = [driver for driver, _, _ in built]
        # one checkpointer per driver that checkpoints: the same cadence, retention, retries and owner check
        self.checkpointers = {
            id(driver): Checkpointer(
                driver, folder, config.trainer.checkpoint, self.owner, client, config.run.name, earlier
            )
            for driver, folder, earlier in built
            if folder is not None
        }
        for checkpointer in self.checkpointers.values():
            checkpointer.resume()

    def status(self) -> services_pb2.TrainerStatus:
        """The drivers' and their checkpoints' parts in one; the updates each undid and the writes each had
        refused add up, the write failing longest is named."""
        status = services_pb2.TrainerStatus(incarnation=self.incarnation)
        parts = [d.status() for d in self.drivers] + [c.status() for c in self.checkpointers.values()]
        if self.tensorboard is not None:
            parts.append(services_pb2.TrainerStatus(**write_figures(self.tensorboard.writes)))
        undone, failed, failing = 0, Counter[str](), (0.0, "")
        for part in parts:
            undone += part.updates_discarded_nonfinite
            failed.update(part.writes_failed)
            failing = max(failing, (part.write_failing_s, part.write_failure))
            status.MergeFrom(part)
        status.updates_discarded_nonfinite = undone
        status.writes_failed.update(failed)
        status.write_failing_s, status.write_failure = failing
        return status

    def add_to(self, server: grpc.Server) -> None:
        """No RPCs of its own besides health and status."""

    def run(self, stop: threading.Event) -> None:
        """Every driver in a thread of its own until one ends (SIGTERM ends them all), then each one's last
        checkpoint written and all of them closed, last to first, and the first error raised; with no driver, until
        SIGTERM. This thread asks the checkpointers ten times a second whether a checkpoint is due (a driver hands out
        its state between two of its steps) and otherwise waits: the kernel may hand a SIGTERM to any thread, and
        its handler runs in this one."""
        with ThreadPoolExecutor(max(len(self.drivers), 1), thread_name_prefix="driver") as pool:
            runs = [pool.submit(_run_until_one_ends, driver, stop) for driver in self.drivers]
            runs = runs or [pool.submit(stop.wait)]
            try:
                while futures.wait(runs, timeout=CHECK_S).not_done:
                    for checkpointer in self.checkpointers.values():
                        checkpointer.save()  # RunFolderInUse: the folder is another run's now, the trainer stops
                for run in runs:
                    run.result()
            finally:
                stop.set()
                futures.wait(runs)
                self._close()

    def _close(self) -> None:
        try:
            for driver in reversed(self.drivers):
                if (checkpointer := self.checkpointers.get(id(driver))) is not None:
                    checkpointer.close()
                driver.close()
        finally:
            try:
                if self.tensorboard is not None:
                    self.tensorboard.close()
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
        # after limit_blas_threads: it may be the same BLAS
        torch.set_num_threads(config.trainer.threads())
        return TrainerService(config, client, run_dir, incarnation)

    service_host.serve("trainer", config, redis_url, endpoint, build)
