"""Applies the Tinker API's requests in lanes, taking them from the store the API queued them in and writing their
outcomes back there (the two meet nowhere else): each training model is a lane (its requests in the order of their
numbers), and so is each sample request (sampled in the sampling process, in its model's running batch). Lanes run in
threads of their own, one request at a time each, so one model's long request never holds another model back; a
model is only ever touched by its lane's thread. LoRA models of one base whose next requests are all
``forward_backward`` (or forward) run together instead, in one thread and one batched pass
(``trainer.tinker.batch_models``), each request still recorded on its own, in its model's order. What it applies
it records in the store, and a model's state is snapshotted after every request that changes it, before that
request counts as applied; a restarted worker rebuilds each model from its snapshot and replays the gradient
accumulations applied since (``recovery.py``).

Each request has a budget: at most ``trainer.tinker.max_request_tokens`` tokens (checked by the API before it is
queued) and ``trainer.tinker.max_request_s`` seconds of work, past which it fails as the client's error.

What each kind of request does is ``handlers.py``'s (``RequestHandlers.table`` lists them); how a request is
applied and recorded ``applying.py``'s; the lanes' state the dispatcher shares with their threads ``lanes.py``'s; the
files on disk ``saving.py``'s.
"""

from __future__ import annotations

import logging
import os
import threading

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.state.run_dir import RunFolderOwner
from tinker_atropos.tinker_api.engine.applying import Applier
from tinker_atropos.tinker_api.engine.dispatch import next_jobs, together
from tinker_atropos.tinker_api.engine.expiry import SessionExpiry
from tinker_atropos.tinker_api.engine.handlers import RequestHandlers
from tinker_atropos.tinker_api.engine.lanes import Lanes
from tinker_atropos.tinker_api.engine.sampling_process import SamplingProcess, Settings
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.engine.training_steps import StepLog
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.samplers import SAMPLER_LANE
from tinker_atropos.training.guard import NonfiniteGuard

log = logging.getLogger(__name__)


class Worker:
    """Runs the queued requests in their lanes, records what each did, and rebuilds the models after a restart."""

    def __init__(
        self,
        store: Store,
        client: redis.Redis,
        config: Config,
        device: torch.device,
        owner: RunFolderOwner | None = None,
        training_log: StepLog | None = None,
    ) -> None:
        """``training_log``: where each model's optimizer steps are told (the trainer's TensorBoard log)."""
        self.store, self.config = store, config
        section = config.trainer
        self.sampling = SamplingProcess(Settings(section.model, str(device), config.run.seed, section.tinker))
        self.stopping = threading.Event()
        # batched passes side by side: one on a GPU; on a CPU, where a pass is compute-bound in its intra-op
        # threads, as many as keep every core busy (one pass in one thread would leave the others idle)
        cores = len(os.sched_getaffinity(0)) // section.threads()
        self.passes = 1 if device.type == "cuda" else max(1, cores)
        # every write into the run folder checked to be still this run's: RunFolderInUse stops the worker
        self.checkpoints = Checkpoints(store.files, owner)
        # every model's steps: counts those it undid (the trainer's status reads it)
        self.guard = NonfiniteGuard()
        self.requests = RequestHandlers(
            store,
            client,
            config,
            self.checkpoints,
            self.sampling,
            self.guard,
            self.stopping,
            device,
            training_log,
        )
        # woken by the API as it queues a request or refuses a number (through the store), and by a lane's end
        self.lanes = Lanes(store.requests.arrived)
        self.applier = Applier(
            store, self.requests, self.checkpoints, self.sampling, self.lanes, self.stopping, section.tinker
        )
        self.expiry = SessionExpiry(
            store,
            section.tinker.session_timeout_s,
            lambda model_id: store.requests.submit("unload_model", b"", model_id=model_id),
            self.sampling.cancel,
        )

    def recover(self) -> None:
        """Rebuild every model a previous incarnation served, up to the last request it applied."""
        self.applier.recover()

    def run(self, stop: threading.Event) -> None:
        """Dispatch requests to their lanes until ``stop``; then let the lanes finish (a sample is interrupted
        and left pending)."""
        self.recover()
        while not stop.is_set():
            # before reading the store: a request or a lane's end after it wakes the next wait
            self.lanes.wake.clear()
            try:
                self.cancel_ended()
                self.checkpoints.expire()
                self.dispatch(threaded=True)
            except redis.RedisError as error:
                log.warning("Tinker requests unreadable (%s); retrying", error)
            self.lanes.wake.wait(0.5)
            if self.applier.fatal is not None:  # the run folder is another run's: the trainer stops
                raise self.applier.fatal
        self.close()

    def cancel_ended(self) -> None:
        """Expire the silent sessions, and cancel the samples of the ended ones (``SessionExpiry``)."""
        self.expiry.cancel_ended(self.requests.models, self.lanes.sampling_tenants())

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: the samples in progress are interrupted (they run again after a restart), other requests end."""
        self.stopping.set()
        self.sampling.close()
        self.lanes.join(timeout_s)

    def step(self) -> bool:
        """Apply, in this thread, the next request of every lane that has one; whether any ran (how the tests
        drive the worker)."""
        return self.dispatch(threaded=False)

    def dispatch(self, threaded: bool) -> bool:
        """Start the next request of every idle lane: a model's next number (or the failure a refused number is
        answered with), a sampler's oldest queued request. Whether one started."""
        applied, busy = self.lanes.view()
        upcoming = self.store.requests.next_requests(applied)
        self.lanes.learn(applied)
        tinker = self.config.trainer.tinker
        jobs = next_jobs(
            upcoming, applied, busy, tinker.max_running_samples, self.store.requests.take_refusal
        )
        if any(lane.startswith(SAMPLER_LANE) for lane, _, _ in jobs):
            self.sampling.ensure_started()  # from this long-lived thread: see SamplingProcess
        if tinker.batch_models:
            runs = together(jobs, self.requests.models, self.store.requests.kinds, self.passes)
        else:
            runs = [[job] for job in jobs]
        for run in runs:
            self.lanes.start(run, self.applier.run, threaded)
        return bool(jobs)
