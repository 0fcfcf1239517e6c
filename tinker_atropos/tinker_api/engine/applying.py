"""How the worker applies a lane's request and records it for good: the request read from the store, its handler run
(``RequestHandlers.table``; the ``forward_backward`` requests of a batched pass together), the model's state
snapshotted after a request that changes it, and the outcome stored in one transaction with the number it applied,
retried while Redis is away: applied once, a request must never be applied again. Per model it keeps the gradient
accumulations applied since the model's snapshot, which a restart replays (``recovery.py``), their payloads kept in
the store until a later snapshot or the model's unload makes them unneeded."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from tinker_atropos.config import TinkerSection
from tinker_atropos.state.run_dir import RunFolderInUse
from tinker_atropos.tinker_api.engine.dispatch import Job
from tinker_atropos.tinker_api.engine.handlers import RequestHandlers
from tinker_atropos.tinker_api.engine.lanes import Lanes
from tinker_atropos.tinker_api.engine.recovery import recover
from tinker_atropos.tinker_api.engine.responses import JSON, json_body
from tinker_atropos.tinker_api.engine.sampling_process import Interrupted, SamplingProcess
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.queue import DONE, FAILED
from tinker_atropos.tinker_api.store.samplers import SAMPLER_LANE
from tinker_atropos.training.data import ClientError

log = logging.getLogger(__name__)

_STATE_CHANGING = {"create_model", "create_from_state", "optim_step", "load_weights"}
Request = tuple[str, bytes, str, int]  # (kind, body, model, number), as the store keeps it
Position = tuple[str, int] | None  # (model, number) of a numbered request
Outcome = tuple[bytes, bytes, str]  # (status, body, content type)
Snapshot = tuple[int, str] | None  # (number, file) of the model's state it left
FINISH_RETRY_S = 1.0  # between two tries to record an applied request's outcome while Redis is away


class Applier:
    """Applies the runs the lanes start and records their outcomes; ``fatal``: the RunFolderInUse a write met (the
    run folder is another run's: the worker stops), ``since_snapshot``: per model, the requests a replay needs."""

    def __init__(
        self,
        store: Store,
        handlers: RequestHandlers,
        checkpoints: Checkpoints,
        sampling: SamplingProcess,
        lanes: Lanes,
        stopping: threading.Event,
        settings: TinkerSection,
    ) -> None:
        self.store, self.handlers, self.checkpoints, self.sampling = store, handlers, checkpoints, sampling
        self.lanes, self.stopping, self.settings = lanes, stopping, settings
        self.since_snapshot: dict[str, list[str]] = {}
        self.fatal: RunFolderInUse | None = None

    def recover(self) -> None:
        """Rebuild every model a previous incarnation served, up to the last request it applied."""
        models, training = self.handlers.models, self.handlers.training
        self.since_snapshot.update(recover(self.store, models, training, self.checkpoints))

    def run(self, run: list[Job]) -> None:
        """A lane's next request, or several models' run together; an error leaves the requests queued."""
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
        deadline = time.monotonic() + self.settings.max_request_s
        try:
            handler = self.handlers.table.get(kind)
            if handler is None:
                raise LookupError(f"no handler for a {kind!r} request")
            result, content_type = handler(model_id, seq, body, deadline)
            if kind == "sample":
                self.handlers.stability.add(request_id, body, result)
            if position is not None and kind in _STATE_CHANGING and model_id in self.handlers.models:
                snapshot = self.checkpoints.write_snapshot(
                    model_id, seq, self.handlers.models.state(model_id)
                )
            outcome = DONE, result, content_type
        except (Interrupted, RunFolderInUse):
            raise
        except Exception as error:
            outcome = failed(request_id, kind, error)
        self._record(request_id, request, position, outcome, snapshot)

    def _apply_together(self, run: list[Job]) -> None:
        """Several models' ``forward_backward`` requests in one batched pass, each then recorded as if it had run
        alone, in its model's order; one that fails (its data, its budget) fails alone."""
        deadline = time.monotonic() + self.settings.max_request_s
        read = [
            (request_id, position, request)
            for _, request_id, position in run
            if (request := self._read(request_id, position)) is not None
        ]
        together = [(request[2], request[1]) for _, _, request in read]
        for (request_id, position, request), outcome in zip(
            read, self.handlers.training.forward_backward_together(together, deadline), strict=True
        ):
            done = (DONE, *outcome) if isinstance(outcome, tuple) else failed(request_id, request[0], outcome)
            self._record(request_id, request, position, done, None)

    def _record(
        self, request_id: str, request: Request, position: Position, outcome: Outcome, snapshot: Snapshot
    ) -> None:
        """Store an applied request's outcome, and what a replay after a restart needs of it: no accumulation of
        the model's before a snapshot it left or its unload."""
        kind, model_id, status = request[0], request[2], outcome[0]
        if kind == "forward_backward" and status == DONE:
            self.since_snapshot.setdefault(model_id, []).append(request_id)
        self._finish(request_id, outcome, position, snapshot)
        if snapshot is not None:
            self.checkpoints.snapshot_taken(model_id, snapshot[1])
        if snapshot is not None or kind == "unload_model":
            for done in self.since_snapshot.pop(model_id, []):
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
            self.lanes.applied_to(*position)


def failed(request_id: str, kind: str, error: Exception) -> Outcome:
    """The outcome of a request that raised ``error``: the client's (a ClientError: a WireError, a datum or loss the
    model cannot take) or the server's."""
    if isinstance(error, ClientError):
        return FAILED, json_body(error=str(error), category="user"), JSON
    log.error("Tinker request %s (%s) failed", request_id, kind, exc_info=error)
    return FAILED, json_body(error=f"{type(error).__name__}: {error}", category="server"), JSON
