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

What each kind of request does is ``requests.py``'s (``Worker.handlers`` lists them); the files on disk are
``checkpoints.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.state.run_dir import RunFolderInUse, RunFolderOwner
from tinker_atropos.tinker_api.engine.dispatch import Job, lane_tenant, next_jobs, together
from tinker_atropos.tinker_api.engine.expiry import SessionExpiry
from tinker_atropos.tinker_api.engine.handlers import JSON, Handler, RequestHandlers, json_body, refused
from tinker_atropos.tinker_api.engine.recovery import recover
from tinker_atropos.tinker_api.engine.sampling_process import Interrupted, SamplingProcess, Settings
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.queue import DONE, FAILED
from tinker_atropos.tinker_api.store.samplers import SAMPLER_LANE
from tinker_atropos.training.data import ClientError
from tinker_atropos.training.guard import NonfiniteGuard

log = logging.getLogger(__name__)

_STATE_CHANGING = {"create_model", "create_from_state", "optim_step", "load_weights"}
# the kinds of request the store queues that the RequestHandlers method of that name applies
HANDLED = (
    "create_model",
    "create_from_state",
    "load_weights",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "save_weights_external",
    "sample",
)
Request = tuple[str, bytes, str, int]  # (kind, body, model, number), as the store keeps it
Position = tuple[str, int] | None  # (model, number) of a numbered request
Outcome = tuple[bytes, bytes, str]  # (status, body, content type)
Snapshot = tuple[int, str] | None  # (number, file) of the model's state it left
FINISH_RETRY_S = 1.0  # between two tries to record an applied request's outcome while Redis is away


class Worker:
    """Runs the queued requests in their lanes, records what each did, and rebuilds the models after a restart."""

    def __init__(
        self,
        store: Store,
        client: redis.Redis,
        config: Config,
        device: torch.device,
        owner: RunFolderOwner | None = None,
    ) -> None:
        self.store, self.config = store, config
        section = config.trainer
        self.sampling = SamplingProcess(Settings(section.model, str(device), config.run.seed, section.tinker))
        # rung by the API as it queues a request or refuses a number (through the store), and by a lane's end
        self.wake = store.requests.arrived
        self.stopping = threading.Event()
        # batched passes side by side: one on a GPU; on a CPU, where a pass is compute-bound in its intra-op
        # threads, as many as keep every core busy (one pass in one thread would leave the others idle)
        cores = len(os.sched_getaffinity(0)) // section.threads()
        self.passes = 1 if device.type == "cuda" else max(1, cores)
        # every write into the run folder checked to be still this run's: RunFolderInUse stops the worker
        self.checkpoints = Checkpoints(store.files, owner)
        self.fatal: RunFolderInUse | None = None
        # every model's steps: counts those it undid (the trainer's status reads it)
        self.guard = NonfiniteGuard()
        self.requests = RequestHandlers(
            store, client, config, self.checkpoints, self.sampling, self.guard, self.stopping, device
        )
        self.handlers: dict[str, Handler] = {kind: getattr(self.requests, kind) for kind in HANDLED}
        self.handlers |= {"unload_model": self._unload_model, "refused": refused}
        self.since_snapshot: dict[str, list[str]] = {}  # requests a replay needs, per model
        # the dispatcher's state, shared with the lanes' threads under ``lock``: the last request number applied
        # per model (this worker is its only writer) and the lanes running a request (lane -> request id)
        self.lock = threading.Lock()
        self.applied: dict[str, int] = {}
        self.busy: dict[str, str] = {}
        self.threads: set[threading.Thread] = set()
        self.expiry = SessionExpiry(
            store,
            section.tinker.session_timeout_s,
            lambda model_id: store.requests.submit("unload_model", b"", model_id=model_id),
            self.sampling.cancel,
        )

    def recover(self) -> None:
        """Rebuild every model a previous incarnation served, up to the last request it applied."""
        self.since_snapshot.update(recover(self.store, self.requests, self.checkpoints))

    def run(self, stop: threading.Event) -> None:
        """Dispatch requests to their lanes until ``stop``; then let the lanes finish (a sample is interrupted
        and left pending)."""
        self.recover()
        while not stop.is_set():
            self.wake.clear()  # before reading the store: a request or a lane's end after it wakes the next wait
            try:
                self.cancel_ended()
                self.checkpoints.expire()
                self.dispatch(threaded=True)
            except redis.RedisError as error:
                log.warning("Tinker requests unreadable (%s); retrying", error)
            self.wake.wait(0.5)
            if self.fatal is not None:  # the run folder is another run's: the trainer stops, nothing recorded
                raise self.fatal
        self.close()

    def cancel_ended(self) -> None:
        """Expire the silent sessions, and cancel the samples of the ended ones (``SessionExpiry``)."""
        with self.lock:
            running = {lane_tenant(lane) for lane in self.busy if lane.startswith(SAMPLER_LANE)}
        self.expiry.cancel_ended(self.requests.models, running)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: the samples in progress are interrupted (they run again after a restart), other requests end."""
        self.stopping.set()
        self.sampling.close()
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def step(self) -> bool:
        """Apply, in this thread, the next request of every lane that has one; whether any ran (how the tests
        drive the worker)."""
        return self.dispatch(threaded=False)

    def dispatch(self, threaded: bool) -> bool:
        """Start the next request of every idle lane: a model's next number (or the failure a refused number is
        answered with), a sampler's oldest queued request. Whether one started."""
        with self.lock:
            applied, busy = dict(self.applied), set(self.busy)
        upcoming = self.store.requests.next_requests(applied)
        with self.lock:
            for model_id, seq in applied.items():
                self.applied.setdefault(model_id, seq)
            for model_id in [m for m in self.applied if m not in applied and m not in self.busy]:
                del self.applied[model_id]  # unloaded
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
            with self.lock:
                self.busy.update({lane: request_id for lane, request_id, _ in run})
            if threaded:
                thread = threading.Thread(
                    target=self._run_lanes,
                    args=(run,),
                    daemon=True,
                    name=f"tinker-lane {'+'.join(lane for lane, _, _ in run)}",
                )
                self.threads.add(thread)
                thread.start()
            else:
                self._run_lanes(run)
        return bool(jobs)

    def _run_lanes(self, run: list[Job]) -> None:
        """A lane's next request, or several models' run together; their lanes are free again after."""
        training = (
            contextlib.nullcontext()
            if run[0][0].startswith(SAMPLER_LANE)
            else self.sampling.training_request()
        )
        ids = ", ".join(request_id for _, request_id, _ in run)
        try:
            with training:
                if len(run) == 1:
                    self._apply(run[0][1], run[0][2])
                else:
                    self._apply_together(run)
        except RunFolderInUse as error:  # the request stays queued, for the run that owns the folder
            self.fatal = error
        except Interrupted:
            log.info("Tinker request %s interrupted by the shutdown; it runs again after the restart", ids)
        except Exception:  # Redis away before the request was applied: it stays queued, tried again
            log.exception("Tinker request %s could not be applied; it stays queued", ids)
        finally:
            with self.lock:
                for lane, _, _ in run:
                    self.busy.pop(lane, None)
            self.threads.discard(threading.current_thread())
            self.wake.set()

    def _read(self, request_id: str, position: Position) -> Request | None:
        """The request's (kind, body, model, number); None when it has no payload (it is answered as lost)."""
        request = self.store.requests.request(request_id)
        if request is None:  # expired or never written: nothing to answer, but the sequence goes on
            log.warning("Tinker request %s has no payload; skipped", request_id)
            lost = FAILED, json_body(error="request lost", category="server"), JSON
            self._finish(request_id, lost, position, None)
        return request

    def _apply(self, request_id: str, position: Position) -> None:
        request = self._read(request_id, position)
        if request is None:
            return
        kind, body, model_id, seq = request
        snapshot = None
        deadline = time.monotonic() + self.config.trainer.tinker.max_request_s
        try:
            handler = self.handlers.get(kind)
            if handler is None:
                raise LookupError(f"no handler for a {kind!r} request")
            result, content_type = handler(model_id, seq, body, deadline)
            if kind == "sample":
                self.requests.stability.add(request_id, body, result)
            if position is not None and kind in _STATE_CHANGING and model_id in self.requests.models:
                snapshot = self.checkpoints.write_snapshot(model_id, seq, self.requests.state(model_id))
            outcome = DONE, result, content_type
        except (Interrupted, RunFolderInUse):
            raise
        except Exception as error:
            outcome = failed(request_id, kind, error)
        self._record(request_id, request, position, outcome, snapshot)

    def _apply_together(self, run: list[Job]) -> None:
        """Several models' ``forward_backward`` requests in one batched pass, each then recorded as if it had run
        alone, in its model's order; one that fails (its data, its budget) fails alone."""
        deadline = time.monotonic() + self.config.trainer.tinker.max_request_s
        read = [
            (request_id, position, request)
            for _, request_id, position in run
            if (request := self._read(request_id, position)) is not None
        ]
        together = [(request[2], request[1]) for _, _, request in read]
        for (request_id, position, request), outcome in zip(
            read, self.requests.forward_backward_together(together, deadline), strict=True
        ):
            done = (DONE, *outcome) if isinstance(outcome, tuple) else failed(request_id, request[0], outcome)
            self._record(request_id, request, position, done, None)

    def _record(
        self, request_id: str, request: Request, position: Position, outcome: Outcome, snapshot: Snapshot
    ) -> None:
        """Store an applied request's outcome, and what a replay after a restart needs of it."""
        kind, model_id, status = request[0], request[2], outcome[0]
        if kind == "forward_backward" and status == DONE:
            self.since_snapshot.setdefault(model_id, []).append(request_id)
        self._finish(request_id, outcome, position, snapshot)
        if snapshot is not None:
            self.checkpoints.snapshot_taken(model_id, snapshot[1])
            for done in self.since_snapshot.pop(model_id, []):  # a replay needs them no more
                self.store.requests.forget_payload(done)
        if status == FAILED and kind in ("create_model", "create_from_state"):
            self.store.models.unload(model_id)  # no model came of it: its later requests are refused at once

    def _finish(self, request_id: str, outcome: Outcome, position: Position, snapshot: Snapshot) -> None:
        """Record an applied request's outcome, retrying while Redis is away: applied once, it must not be
        applied again (a gradient accumulated twice)."""
        while True:
            try:
                self.store.requests.finish(request_id, *outcome, applied=position, snapshot=snapshot)
                break
            except redis.RedisError as error:
                if self.stopping.is_set():
                    raise
                log.warning("cannot record Tinker request %s (%s); retrying", request_id, error)
                time.sleep(FINISH_RETRY_S)
        if position is not None:
            with self.lock:
                self.applied[position[0]] = position[1]

    def _unload_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        """Unload the model; a request of it still waiting (behind a number that never came) fails, saying so.
        Its snapshot goes: no request can run on it any more, and a restart rebuilds only loaded models."""
        self.requests.models.pop(model_id, None)
        self.store.models.unload(model_id)
        self.checkpoints.unloaded(model_id)
        for done in self.since_snapshot.pop(model_id, []):
            self.store.requests.forget_payload(done)
        with self.lock:
            applied = self.applied.get(model_id, self.store.models.progress(model_id)[0])
        reason = json_body(
            error=f"model {model_id!r} was unloaded (unload_model, or its session finished) before this "
            "request could run",
            category="user",
        )
        for request_id in self.store.requests.waiting(model_id, after=applied):
            self.store.requests.finish(request_id, FAILED, reason, JSON)
        return json_body(model_id=model_id, type="unload_model"), JSON


def failed(request_id: str, kind: str, error: Exception) -> Outcome:
    """The outcome of a request that raised ``error``: the client's (a ClientError: a WireError, a datum or loss the
    model cannot take) or the server's."""
    if isinstance(error, ClientError):
        return FAILED, json_body(error=str(error), category="user"), JSON
    log.error("Tinker request %s (%s) failed", request_id, kind, exc_info=error)
    return FAILED, json_body(error=f"{type(error).__name__}: {error}", category="server"), JSON
