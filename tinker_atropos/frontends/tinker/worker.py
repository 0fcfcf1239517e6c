"""Applies the Tinker API's requests in lanes: each training model is a lane (its requests in the order of their
numbers), and so is each sampler (a base model or saved weights; its requests in arrival order). Lanes run in
threads of their own, one request at a time each, so one model's long request never holds another model back; a
model is only ever touched by its lane's thread. What it applies it records in the store, and a model's state is
snapshotted after every request that changes it, before that request counts as applied; a restarted worker
rebuilds each model from its snapshot and replays the gradient accumulations applied since.

Each request has a budget: at most ``trainer.tinker.max_request_tokens`` tokens (checked by the API before it is
queued) and ``trainer.tinker.max_request_s`` seconds of work, past which it fails as the client's error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.frontends.tinker import registry, wire
from tinker_atropos.frontends.tinker.sampling import Interrupted, Job, SamplingProcess, Settings
from tinker_atropos.frontends.tinker.stability import Record
from tinker_atropos.frontends.tinker.store import DONE, FAILED, SAMPLER_LANE, Store
from tinker_atropos.security import signing_key
from tinker_atropos.state.checkpoints import save_torch, write_atomically
from tinker_atropos.state.weights import publish_weights
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.data import ClientError
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import LANGUAGE_MODELS, PolicyModel, ServedModel, checkpoint, run_loss

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_STATE_CHANGING = {"create_model", "create_from_state", "optim_step", "load_weights"}
FINISH_RETRY_S = 1.0  # between two tries to record an applied request's outcome while Redis is away
EPHEMERAL = "ephemeral-"  # the name of the weights a sampling client was made with, saved under no name
CHECKPOINT_SWEEP_S = 1.0  # between two looks for checkpoints past their ttl_seconds


def _parts(path: str) -> tuple[str, str, str]:
    """The model, kind and name of a ``tinker://<model>/<weights|sampler_weights>/<name>`` path."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not _NAME.match(parts[2]):
        raise wire.WireError(f"{path!r} is no tinker://<model>/weights/<name> path of this server")
    return parts[0], parts[1], parts[2]


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


class Worker:
    def __init__(self, store: Store, client: redis.Redis, config: Config, checkpoints: Path,
                 device: torch.device, on_done: Callable[[str], None] = lambda request_id: None) -> None:  # fmt: skip
        self.store, self.client, self.config, self.root = store, client, config, checkpoints
        self.device, self.on_done = device, on_done
        self.models: dict[str, ServedModel] = {}
        self.guard = NonfiniteGuard()  # every model's steps: counts those it undid
        self.stability = Record(client, store.run)  # what samplers recorded for stable_reinforce
        self.since_snapshot: dict[str, list[str]] = {}  # requests a replay needs, per model
        section = config.trainer
        self.sampling = SamplingProcess(Settings(section.model, str(device), config.run.seed, section.torch_threads,
                                                 section.tinker.max_samplers))  # fmt: skip
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.snapshots: dict[str, str] = {}  # the snapshot file the store points at, per model
        # the dispatcher's state, shared with the lanes' threads under ``lock``: the last request number applied
        # per model (this worker is its only writer) and the lanes running a request (lane -> request id)
        self.lock = threading.Lock()
        self.applied: dict[str, int] = {}
        self.busy: dict[str, str] = {}
        self.threads: set[threading.Thread] = set()
        self.started = time.time()
        self.next_expiry_check = 0.0
        self.next_checkpoint_sweep = 0.0

    # paths ---------------------------------------------------------------------------------------------
    def _dir(self, model_id: str) -> Path:
        return self.root / model_id.replace(":", "_")

    def tinker_path(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def file_of(self, path: str) -> Path:
        """The file behind a ``tinker://<model>/<weights|sampler_weights>/<name>`` path."""
        model_id, kind, name = _parts(path)
        file = self._dir(model_id) / kind / f"{name}.pt"
        if not file.exists():
            raise wire.WireError(f"no checkpoint {path!r} on this server (never saved, deleted, past its ttl_seconds, "
                                 "or, saved under no name by save_weights_and_get_sampling_client, unused for "
                                 f"{self.config.trainer.tinker.ephemeral_weights_ttl_s:g} s)")  # fmt: skip
        return file

    def _save(self, file: Path, payload: dict[str, Any]) -> None:
        """The checkpoint, and beside it its record (base model, LoRA) as JSON, written first: what a sampling
        session or a new model needs to know of a checkpoint is read without loading it."""
        record = json.dumps(payload["record"]).encode()
        write_atomically(file.with_suffix(".json"), lambda out: out.write(record))
        save_torch(file, payload)

    def _saved(self, model_id: str, kind: str, name: str, request: dict[str, Any]) -> str:
        """Record a checkpoint saved under a name, with its ``ttl_seconds`` and ``user_metadata``; its path."""
        ttl = request.get("ttl_seconds")
        now = time.time()
        file = self._dir(model_id) / kind / f"{name}.pt"
        self.store.runs.add_checkpoint(model_id, f"{kind}/{name}", {
            "created_at": now, "size_bytes": file.stat().st_size, "public": False,
            "user_metadata": request.get("user_metadata"), "expires_at": None if ttl is None else now + ttl})  # fmt: skip
        return self.tinker_path(model_id, kind, name)

    def _keep_ephemeral(self, path: str) -> None:
        """The unnamed weights behind ``path`` are deleted once no sample used them for
        ``trainer.tinker.ephemeral_weights_ttl_s``: an RL loop saves one per step, and none is listed."""
        model_id, kind, name = _parts(path)
        ttl = self.config.trainer.tinker.ephemeral_weights_ttl_s
        self.store.runs.expire_at(model_id, f"{kind}/{name}", time.time() + ttl)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> bool:
        """Delete a checkpoint's files and its record; False when there was no such checkpoint."""
        kind, _, name = checkpoint_id.partition("/")
        known = self.store.runs.remove_checkpoint(model_id, checkpoint_id)
        if kind not in ("weights", "sampler_weights") or not _NAME.match(name):
            return known
        file = self._dir(model_id) / kind / f"{name}.pt"
        existed = file.exists()
        file.unlink(missing_ok=True)
        file.with_suffix(".json").unlink(missing_ok=True)
        return known or existed

    def expire_checkpoints(self) -> None:
        """Delete the checkpoints whose ``ttl_seconds`` ran out, and the unnamed weights no sample used for
        ``ephemeral_weights_ttl_s`` (checked every ``CHECKPOINT_SWEEP_S``)."""
        now = time.time()
        if now < self.next_checkpoint_sweep:
            return
        self.next_checkpoint_sweep = now + CHECKPOINT_SWEEP_S
        for model_id, checkpoint_id in self.store.runs.expired_checkpoints(now):
            self.delete_checkpoint(model_id, checkpoint_id)
            log.info("Tinker checkpoint %s of %s expired: deleted", checkpoint_id, model_id)

    def checkpoint_record(self, path: str) -> dict[str, Any]:
        """The record of the checkpoint behind a ``tinker://`` path; WireError if there is none."""
        return json.loads(self.file_of(path).with_suffix(".json").read_text())

    def _state(self, model_id: str, optimizer: bool = True) -> dict[str, Any]:
        return checkpoint(self.models[model_id], self.store.model(model_id), optimizer)

    def _build(self, record: dict[str, Any]) -> ServedModel:
        lora = record.get("lora") or {}
        seed = lora.get("seed") if lora.get("seed") is not None else self.config.run.seed
        return registry.build(record["base_model"], lora, self.config.trainer.model, self.device, seed)

    def _write_snapshot(self, model_id: str, seq: int) -> tuple[int, str]:
        """The model's state after its request ``seq``, to a file of its own: the store points at it only in the
        transaction that records the request as applied, so a crash in between leaves the previous snapshot."""
        file = self._dir(model_id) / f"state-{seq:09d}.pt"
        self._save(file, self._state(model_id))
        return seq, str(file)

    def _snapshot_taken(self, model_id: str, path: str) -> None:
        """Once the store points at ``path``: the older snapshot and the payloads a replay needed go."""
        previous = self.snapshots.get(model_id)
        if previous is not None and previous != path:
            Path(previous).unlink(missing_ok=True)
            Path(previous).with_suffix(".json").unlink(missing_ok=True)
        self.snapshots[model_id] = path
        for request_id in self.since_snapshot.pop(model_id, []):
            self.store.forget_payload(request_id)

    # the loop ------------------------------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild every model a previous incarnation served, up to the last request it applied."""
        for model_id in self.store.models():
            applied, snapshot_seq, snapshot = self.store.progress(model_id)
            record = self.store.model(model_id)
            if applied < 0 or record is None or snapshot is None:
                continue
            try:
                model = self._build(record)
                state = torch.load(snapshot, map_location=self.device, weights_only=False)
                model.load_state_dict(state)
            except Exception:
                log.exception("cannot restore Tinker model %s from %s; it stays unloaded", model_id, snapshot)
                continue
            self.models[model_id] = model
            self.snapshots[model_id] = snapshot
            for orphan in self._dir(model_id).glob(
                "state-*.pt"
            ):  # written by a process that died before it counted
                if orphan.stem != Path(snapshot).stem:
                    orphan.unlink()
            replayed = []
            for seq in range(snapshot_seq + 1, applied + 1):
                request_id = self.store.op(model_id, seq)
                request = self.store.request(request_id) if request_id else None
                if request is None or request[0] != "forward_backward" or not request[1]:
                    continue
                parsed = wire.parse_forward_backward(request[1], self.budget())
                if not parsed.forward_only:
                    try:
                        self._forward_backward(model_id, parsed, deadline=None)
                    # the samplers' record it named may have expired since: a warning, never a crash loop
                    except ClientError as error:
                        log.warning("Tinker model %s: accumulated gradients of request %s cannot be replayed (%s); "
                                    "they are lost", model_id, request_id, error)  # fmt: skip
                        continue
                replayed.append(request_id)
            self.since_snapshot[model_id] = replayed
            log.info("Tinker model %s restored (applied %d, %d accumulations replayed)", model_id, applied,
                     len(replayed))  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        """Dispatch requests to their lanes until ``stop``; then let the lanes finish (a sample is interrupted
        and left pending)."""
        self.recover()
        while not stop.is_set():
            self.wake.clear()  # before reading the store: a request or a lane's end after it wakes the next wait
            try:
                self.expire_sessions()
                self.expire_checkpoints()
                self.dispatch(threaded=True)
            except redis.RedisError as error:
                log.warning("Tinker requests unreadable (%s); retrying", error)
            self.wake.wait(0.5)
        self.close()

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
        upcoming = self.store.next_requests(applied)
        with self.lock:
            for model_id, seq in applied.items():
                self.applied.setdefault(model_id, seq)
            for model_id in [m for m in self.applied if m not in applied and m not in self.busy]:
                del self.applied[model_id]  # unloaded
        jobs: list[tuple[str, str, tuple[str, int] | None]] = []
        for model_id in sorted({*upcoming.requests, *upcoming.refused} - busy):
            seq = applied[model_id] + 1
            request_id = upcoming.requests.get(model_id)
            if request_id is None:
                request_id = self.store.take_refusal(model_id, seq, upcoming.refused[model_id])
            jobs.append((model_id, request_id, (model_id, seq)))
        # a lane's requests run one at a time, oldest first: a model's numbered one goes before its unload
        seen = busy | {lane for lane, _, _ in jobs}
        samplers = sum(lane.startswith(SAMPLER_LANE) for lane in busy)
        for request_id, lane in upcoming.queued:
            if lane in seen:
                continue
            seen.add(lane)
            if lane.startswith(SAMPLER_LANE):
                if samplers >= self.config.trainer.tinker.max_samplers:
                    continue
                samplers += 1
                self.sampling.ensure_started()  # from this long-lived thread: see SamplingProcess
            jobs.append((lane, request_id, None))
        for lane, request_id, position in jobs:
            with self.lock:
                self.busy[lane] = request_id
            if threaded:
                thread = threading.Thread(target=self._run_lane, args=(lane, request_id, position),
                                          name=f"tinker-lane {lane}", daemon=True)  # fmt: skip
                self.threads.add(thread)
                thread.start()
            else:
                self._run_lane(lane, request_id, position)
        return bool(jobs)

    def _run_lane(self, lane: str, request_id: str, position: tuple[str, int] | None) -> None:
        training = (
            contextlib.nullcontext() if lane.startswith(SAMPLER_LANE) else self.sampling.training_request()
        )
        try:
            with training:
                self._apply(request_id, position)
        except Interrupted:
            log.info(
                "Tinker request %s interrupted by the shutdown; it runs again after the restart", request_id
            )
        except Exception:  # Redis away before the request was applied: it stays queued, tried again
            log.exception("Tinker request %s could not be applied; it stays queued", request_id)
        finally:
            with self.lock:
                self.busy.pop(lane, None)
            self.threads.discard(threading.current_thread())
            self.wake.set()

    def expire_sessions(self) -> None:
        """Finish the sessions whose client stopped heart-beating (it died without closing), unloading their
        models. A trainer that was itself down gives every client the timeout again from its start."""
        timeout = self.config.trainer.tinker.session_timeout_s
        now = time.time()
        if now < self.next_expiry_check or now - self.started < timeout:
            return
        self.next_expiry_check = now + min(10.0, timeout / 2)
        sessions = {model_id.split(":")[0] for model_id in list(self.models)}
        for session in self.store.stale_sessions(sessions, older_than=now - timeout):
            log.warning("Tinker session %s sent no heartbeat for %.0f s: finished, its models unloaded",
                        session, timeout)  # fmt: skip
            for model_id in self.store.finish_session(session, "heartbeat_expired"):
                self.store.submit("unload_model", b"", model_id=model_id)

    def _apply(self, request_id: str, position: tuple[str, int] | None) -> None:
        request = self.store.request(request_id)
        if request is None:  # expired or never written: nothing to answer, but the sequence goes on
            log.warning("Tinker request %s has no payload; skipped", request_id)
            self._finish(request_id, FAILED, _json(error="request lost", category="server"), "application/json",
                         position, None)  # fmt: skip
            return
        kind, body, model_id, seq = request
        snapshot = None
        deadline = time.monotonic() + self.config.trainer.tinker.max_request_s
        try:
            result, content_type = getattr(self, f"_do_{kind}")(model_id, seq, body, deadline)
            if kind == "sample":
                self.stability.add(request_id, body, result)
            if position is not None and kind in _STATE_CHANGING and model_id in self.models:
                snapshot = self._write_snapshot(model_id, seq)
            status = DONE
        except Interrupted:
            raise
        except ClientError as error:  # the request's own: a WireError, a datum or loss the model cannot take
            result, content_type = _json(error=str(error), category="user"), "application/json"
            status = FAILED
        except Exception as error:
            log.exception("Tinker request %s (%s) failed", request_id, kind)
            message = f"{type(error).__name__}: {error}"
            result, content_type, status = _json(error=message, category="server"), "application/json", FAILED
        if kind == "forward_backward" and status == DONE:
            self.since_snapshot.setdefault(model_id, []).append(request_id)
        self._finish(request_id, status, result, content_type, position, snapshot)
        if snapshot is not None:
            self._snapshot_taken(model_id, snapshot[1])
        if status == FAILED and kind in ("create_model", "create_from_state"):
            self.store.unload_model(model_id)  # no model came of it: its later requests are refused at once

    def _finish(self, request_id: str, status: bytes, result: bytes, content_type: str,
                position: tuple[str, int] | None, snapshot: tuple[int, str] | None) -> None:  # fmt: skip
        """Record an applied request's outcome, retrying while Redis is away: applied once, it must not be
        applied again (a gradient accumulated twice)."""
        while True:
            try:
                self.store.finish(
                    request_id, status, result, content_type, applied=position, snapshot=snapshot
                )
                break
            except redis.RedisError as error:
                if self.stopping.is_set():
                    raise
                log.warning("cannot record Tinker request %s (%s); retrying", request_id, error)
                time.sleep(FINISH_RETRY_S)
        if position is not None:
            with self.lock:
                self.applied[position[0]] = position[1]
        self.on_done(request_id)

    def _model(self, model_id: str) -> ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise wire.WireError(f"model {model_id!r} is not loaded")
        return model

    # requests ------------------------------------------------------------------------------------------
    def _do_create_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        if len(self.models) >= self.config.trainer.tinker.max_models:
            raise wire.WireError(f"{len(self.models)} models are loaded, the most this server holds "
                                 "(trainer.tinker.max_models); finish a session or unload a model")  # fmt: skip
        self.models[model_id] = self._build(self.store.model(model_id) or {})
        return _json(model_id=model_id, type="create_model"), "application/json"

    def _load(self, model_id: str, path: str, optimizer: bool) -> None:
        state = torch.load(self.file_of(path), map_location=self.device, weights_only=False)
        model = self.models[model_id]
        if state["record"]["base_model"] != model.base_model:
            raise wire.WireError(f"{path} holds a {state['record']['base_model']}, not a {model.base_model}")
        if optimizer and "optimizer" not in state:
            raise wire.WireError(f"{path} holds no optimizer state (it was saved for sampling)")
        model.load_state_dict(state, optimizer)

    def _do_create_from_state(
        self, model_id: str, seq: int, body: bytes, deadline: float
    ) -> tuple[bytes, str]:
        request = json.loads(body)
        # the checkpoint's model (base, LoRA) in this session, with the user metadata this run was created with
        created = self.store.model(model_id) or {}
        record = {**self.checkpoint_record(request["path"]), "session": model_id.split(":")[0],
                  "user_metadata": created.get("user_metadata") or {}}  # fmt: skip
        self.store.update_model(model_id, record)
        self._do_create_model(model_id, seq, b"", deadline)
        try:
            self._load(model_id, request["path"], bool(request.get("optimizer")))
        except Exception:
            self.models.pop(model_id)
            raise
        return _json(path=request["path"], model_id=model_id, type="load_weights"), "application/json"

    def _do_load_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        request = json.loads(body)
        self._model(model_id)
        self._load(model_id, request["path"], bool(request.get("optimizer")))
        return _json(path=request["path"], model_id=model_id, type="load_weights"), "application/json"

    def budget(self) -> wire.Budget:
        """What a request's arrays may take once densified: as much as its body may (a sparse tensor is only
        a compression of what a dense one would have sent)."""
        return wire.Budget(
            int(self.config.trainer.tinker.max_request_mb * 2**20), "trainer.tinker.max_request_mb"
        )

    def _forward_backward(
        self, model_id: str, request: wire.ForwardBackward, deadline: float | None
    ) -> bytes:
        """A forward_backward as applied, or replayed after a restart (the samplers' record is in Redis)."""
        if request.loss_fn == "stable_reinforce":
            self.stability.look_up(model_id, request)
        outputs, metrics = run_loss(self._model(model_id), request.data, request.loss_fn, request.loss_fn_config,
                                    request.forward_only, self._time_check(deadline))  # fmt: skip
        return wire.forward_backward_output(outputs, metrics)

    def _do_forward_backward(
        self, model_id: str, seq: int, body: bytes, deadline: float
    ) -> tuple[bytes, str]:
        request = wire.parse_forward_backward(body, self.budget())
        return self._forward_backward(model_id, request, deadline), PROTOBUF

    def _do_refused(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        raise wire.WireError(body.decode(errors="replace"))

    def _time_check(self, deadline: float | None) -> Callable[[], None]:
        """What a request calls between its steps: it ends the request past its time budget, or when the
        worker stops (the request then runs again after the restart)."""
        limit = self.config.trainer.tinker.max_request_s

        def check() -> None:
            if self.stopping.is_set():
                raise Interrupted
            if deadline is not None and time.monotonic() > deadline:
                raise wire.WireError(f"the request ran past its time budget of {limit:g} s "
                                     "(trainer.tinker.max_request_s); ask for less work per request")  # fmt: skip

        return check

    def _do_optim_step(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        model = self._model(model_id)
        adam = adam_params(json.loads(body).get("adam_params"))
        metrics, bad = self.guard.update(model.core, model, lambda: model.core.optim_step(adam))
        if bad:
            raise wire.WireError(f"the step made {', '.join(bad[:3])} non-finite; it was undone")
        model.core.version += 1
        return _json(metrics={f"{k}:mean": v for k, v in metrics.items()}), "application/json"

    def _named(self, body: bytes) -> tuple[dict[str, Any], str | None]:
        request = json.loads(body)
        name = request.get("path")
        if name is not None and (not _NAME.match(str(name)) or str(name).startswith(EPHEMERAL)):
            raise wire.WireError(f"checkpoint name {name!r}: use letters, digits, '_', '.', '-' (at most 128), not "
                                 f"starting {EPHEMERAL!r} (the unnamed weights of sampling clients)")  # fmt: skip
        ttl = request.get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise wire.WireError(f"ttl_seconds must be a whole number of seconds >= 1, or None; got {ttl!r}")
        return request, name

    def _do_save_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        self._model(model_id)
        request, name = self._named(body)
        name = name or f"step-{seq}"
        file = self._dir(model_id) / "weights" / f"{name}.pt"
        if file.exists() and not request.get("overwrite"):
            raise wire.WireError(
                f"checkpoint {name!r} exists; save under another name or pass overwrite=True"
            )
        self._save(file, self._state(model_id))
        return _json(
            path=self._saved(model_id, "weights", name, request), type="save_weights"
        ), "application/json"

    def _do_save_weights_for_sampler(
        self, model_id: str, seq: int, body: bytes, deadline: float
    ) -> tuple[bytes, str]:
        model = self._model(model_id)
        request, name = self._named(body)
        stored = name or f"{EPHEMERAL}{seq}"
        self._save(
            self._dir(model_id) / "sampler_weights" / f"{stored}.pt", self._state(model_id, optimizer=False)
        )
        path = self.tinker_path(model_id, "sampler_weights", stored)
        if name is None:  # kept while its sampling client samples
            self._keep_ephemeral(path)
        if isinstance(model, PolicyModel):  # the rollouts act with it from now on
            version = publish_weights(self.client, self.config.run.name, 1, model.core.weights(), model.core.spec,
                                      signing_key("weights"))  # fmt: skip
            log.info("Tinker model %s published as policy version %d", model_id, version)
        if name is not None:
            self._saved(model_id, "sampler_weights", name, request)
            return _json(path=path, type="save_weights_for_sampler"), "application/json"
        sampler = f"{model_id.split(':')[0]}:sample:{uuid.uuid4().hex[:12]}"
        self.store.add_sampler(sampler, model.base_model, path)
        return _json(
            path=path, sampling_session_id=sampler, type="save_weights_for_sampler"
        ), "application/json"

    def _do_unload_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        """Unload the model; a request of it still waiting (behind a number that never came) fails, saying so."""
        self.models.pop(model_id, None)
        self.store.unload_model(model_id)
        with self.lock:
            applied = self.applied.get(model_id, self.store.progress(model_id)[0])
        reason = _json(error=f"model {model_id!r} was unloaded (unload_model, or its session finished) before this "
                             "request could run", category="user")  # fmt: skip
        for request_id in self.store.waiting(model_id, after=applied):
            self.store.finish(request_id, FAILED, reason, "application/json")
            self.on_done(request_id)
        return _json(model_id=model_id, type="unload_model"), "application/json"

    def _do_sample(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        """Sampled in the sampling process, from the sampler this request's session names."""
        sampler_id = json.loads(body).get("sampling_session_id") or ""
        found = self.store.sampler(sampler_id)
        if found is None:
            raise wire.WireError(f"no sampling session {sampler_id!r}")
        base_model, path = found
        if base_model not in LANGUAGE_MODELS:
            raise wire.WireError(f"{base_model} is a control policy: it acts through the rollout services, and "
                                 "sample() only returns tokens")  # fmt: skip
        file = str(self.file_of(path)) if path is not None else None
        if path is not None and _parts(path)[2].startswith(EPHEMERAL):
            self._keep_ephemeral(path)
        if self.stopping.is_set():
            raise Interrupted
        budget = self.config.trainer.tinker.max_request_s
        outcome = self.sampling.run(Job(path or base_model, base_model, file, body, deadline, budget))
        if outcome.status == "done":
            return outcome.body, outcome.content_type
        error = json.loads(outcome.body)["error"]
        raise wire.WireError(error) if outcome.status == "user" else RuntimeError(error)


def adam_params(adam: Any) -> AdamParams:
    """The SDK's AdamParams (its defaults where a field is absent) as the training core's; WireError for a value
    no step can be taken with (a NaN learning rate, a beta of 1)."""
    if not isinstance(adam, dict):
        raise wire.WireError("optim_step: this server runs Adam(W) only; send AdamParams")
    defaults = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}  # fmt: skip
    values = {}
    for name, default in defaults.items():
        value = adam.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wire.WireError(f"AdamParams.{name} must be a finite number, got {value!r}")
        values[name] = float(value)
    bounds = {"learning_rate": values["learning_rate"] >= 0, "beta1": 0 <= values["beta1"] < 1,
              "beta2": 0 <= values["beta2"] < 1, "eps": values["eps"] > 0, "weight_decay": values["weight_decay"] >= 0,
              "grad_clip_norm": values["grad_clip_norm"] >= 0}  # fmt: skip
    wrong = [name for name, holds in bounds.items() if not holds]
    if wrong:
        raise wire.WireError(f"AdamParams out of range: {', '.join(f'{n}={values[n]}' for n in wrong)} (learning "
                             "rate, weight decay and clip norm >= 0, betas in [0, 1), eps > 0)")  # fmt: skip
    clip = values["grad_clip_norm"]
    return AdamParams(learning_rate=values["learning_rate"], beta1=values["beta1"], beta2=values["beta2"],
                      eps=values["eps"], weight_decay=values["weight_decay"], grad_clip_norm=clip if clip > 0 else None)  # fmt: skip
