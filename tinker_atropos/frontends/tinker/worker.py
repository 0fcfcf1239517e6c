"""Applies the Tinker API's requests: each model's in the order of their numbers, sampling in arrival order, one
at a time (the training core is not shared between threads). What it applies it records in the store, and a model's
state is snapshotted after every request that changes it, before that request counts as applied; a restarted
worker rebuilds each model from its snapshot and replays the gradient accumulations applied since.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.frontends.tinker import registry, wire
from tinker_atropos.frontends.tinker.losses import LossError, loss_fn
from tinker_atropos.frontends.tinker.store import DONE, FAILED, Store
from tinker_atropos.models import tiny_lm
from tinker_atropos.security import signing_key
from tinker_atropos.state.weights import publish_weights, published_version
from tinker_atropos.trainer.core import AdamParams

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_STATE_CHANGING = {"create_model", "create_from_state", "optim_step", "load_weights"}
_USER_ERRORS = (wire.WireError, LossError)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


class Worker:
    def __init__(self, store: Store, client: redis.Redis, config: Config, checkpoints: Path,
                 device: torch.device, on_done: Callable[[str], None] = lambda request_id: None) -> None:  # fmt: skip
        self.store, self.client, self.config, self.root = store, client, config, checkpoints
        self.device, self.on_done = device, on_done
        self.models: dict[str, registry.ServedModel] = {}
        self.since_snapshot: dict[str, list[str]] = {}  # requests a replay needs, per model
        self.samplers: dict[str, registry.LanguageModel] = {}  # sampler weights by file, a few kept
        self.wake = threading.Event()
        self.last_lane = ""  # the lane (model, or "" for the queue) served last
        self.snapshots: dict[str, str] = {}  # the snapshot file the store points at, per model
        self.applied: dict[
            str, int
        ] = {}  # the last request number applied, per model (this worker writes it)
        self.started = time.time()
        self.next_expiry_check = 0.0

    # paths ---------------------------------------------------------------------------------------------
    def _dir(self, model_id: str) -> Path:
        return self.root / model_id.replace(":", "_")

    def tinker_path(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def file_of(self, path: str) -> Path:
        """The file behind a ``tinker://<model>/<weights|sampler_weights>/<name>`` path."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not _NAME.match(parts[2]):
            raise wire.WireError(f"{path!r} is no tinker://<model>/weights/<name> path of this server")
        file = self._dir(parts[0]) / parts[1] / f"{parts[2]}.pt"
        if not file.exists():
            raise wire.WireError(f"no checkpoint {path!r} on this server")
        return file

    def _save(self, file: Path, payload: dict[str, Any]) -> None:
        """The checkpoint, and beside it its record (base model, LoRA) as JSON, written first: what a sampling
        session or a new model needs to know of a checkpoint is read without loading it."""
        file.parent.mkdir(parents=True, exist_ok=True)
        record, partial = file.with_suffix(".json"), file.with_suffix(".partial")
        record.write_text(json.dumps(payload["record"]))
        torch.save(payload, partial)
        os.replace(partial, file)

    def checkpoint_record(self, path: str) -> dict[str, Any]:
        """The record of the checkpoint behind a ``tinker://`` path; WireError if there is none."""
        return json.loads(self.file_of(path).with_suffix(".json").read_text())

    def _state(self, model_id: str, optimizer: bool = True) -> dict[str, Any]:
        return registry.checkpoint(self.models[model_id], self.store.model(model_id), optimizer)

    def _build(self, record: dict[str, Any]) -> registry.ServedModel:
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
                registry.restore(model, state)
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
                parsed = wire.parse_forward_backward(request[1])
                if not parsed.forward_only:
                    self._forward_backward(model, parsed)
                replayed.append(request_id)
            self.since_snapshot[model_id] = replayed
            log.info("Tinker model %s restored (applied %d, %d accumulations replayed)", model_id, applied,
                     len(replayed))  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        self.recover()
        while not stop.is_set():
            try:
                self.expire_sessions()
                busy = self.step()
            except redis.RedisError as error:
                log.warning("Tinker requests unreadable (%s); retrying", error)
                busy = False
            if not busy:
                self.wake.wait(0.5)
                self.wake.clear()

    def expire_sessions(self) -> None:
        """Finish the sessions whose client stopped heart-beating (it died without closing), unloading their
        models. A trainer that was itself down gives every client the timeout again from its start."""
        timeout = self.config.trainer.tinker.session_timeout_s
        now = time.time()
        if now < self.next_expiry_check or now - self.started < timeout:
            return
        self.next_expiry_check = now + min(10.0, timeout / 2)
        sessions = {model_id.split(":")[0] for model_id in self.models}
        for session in self.store.stale_sessions(sessions, older_than=now - timeout):
            log.warning("Tinker session %s sent no heartbeat for %.0f s: finished, its models unloaded",
                        session, timeout)  # fmt: skip
            for model_id in self.store.finish_session(session, "heartbeat_expired"):
                self.store.submit("unload_model", b"", model_id=model_id)

    def step(self) -> bool:
        """Apply one request if one can run; whether one did. Models and the sampling queue take turns, so that
        a client that queued hundreds of requests does not hold the others back."""
        upcoming, queued = self.store.next_requests(self.applied)
        lanes = [*upcoming, ""]  # "": the queue of requests outside any model's sequence
        start = lanes.index(self.last_lane) + 1 if self.last_lane in lanes else 0
        for lane in lanes[start:] + lanes[:start]:
            request_id = queued if lane == "" else upcoming[lane]
            if request_id is not None:
                self.last_lane = lane
                self._apply(request_id, None if lane == "" else (lane, self.applied[lane] + 1))
                return True
        return False

    def _apply(self, request_id: str, position: tuple[str, int] | None) -> None:
        request = self.store.request(request_id)
        if request is None:  # expired or never written: nothing to answer, but the sequence goes on
            log.warning("Tinker request %s has no payload; skipped", request_id)
            self.store.finish(
                request_id, FAILED, _json(error="request lost", category="server"), applied=position
            )
            if position is not None:
                self.applied[position[0]] = position[1]
            return
        kind, body, model_id, seq = request
        snapshot = None
        try:
            result, content_type = getattr(self, f"_do_{kind}")(model_id, seq, body)
            if position is not None and kind in _STATE_CHANGING and model_id in self.models:
                snapshot = self._write_snapshot(model_id, seq)
            status = DONE
        except _USER_ERRORS as error:
            result, content_type, status = (
                _json(error=str(error), category="user"),
                "application/json",
                FAILED,
            )
        except Exception as error:
            log.exception("Tinker request %s (%s) failed", request_id, kind)
            message = f"{type(error).__name__}: {error}"
            result, content_type, status = _json(error=message, category="server"), "application/json", FAILED
        if kind == "forward_backward" and status == DONE:
            self.since_snapshot.setdefault(model_id, []).append(request_id)
        self.store.finish(request_id, status, result, content_type, applied=position, snapshot=snapshot)
        if position is not None:
            self.applied[position[0]] = position[1]
        if snapshot is not None:
            self._snapshot_taken(model_id, snapshot[1])
        if status == FAILED and kind in ("create_model", "create_from_state"):
            self.store.unload_model(model_id)  # no model came of it: its later requests are refused at once
        self.on_done(request_id)

    def _model(self, model_id: str) -> registry.ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise wire.WireError(f"model {model_id!r} is not loaded")
        return model

    # requests ------------------------------------------------------------------------------------------
    def _do_create_model(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
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
        registry.restore(model, state, optimizer)

    def _do_create_from_state(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        request = json.loads(body)
        record = {**self.checkpoint_record(request["path"]), "session": model_id.split(":")[0]}
        self.store.update_model(model_id, record)
        self._do_create_model(model_id, seq, b"")
        try:
            self._load(model_id, request["path"], bool(request.get("optimizer")))
        except Exception:
            self.models.pop(model_id)
            raise
        return _json(path=request["path"], model_id=model_id, type="load_weights"), "application/json"

    def _do_load_weights(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        request = json.loads(body)
        self._model(model_id)
        self._load(model_id, request["path"], bool(request.get("optimizer")))
        return _json(path=request["path"], model_id=model_id, type="load_weights"), "application/json"

    def _forward_backward(self, model: registry.ServedModel, request: wire.ForwardBackward) -> bytes:
        outputs, metrics = run_loss(model, request.data, request.loss_fn, request.loss_fn_config,
                                    request.forward_only)  # fmt: skip
        return wire.forward_backward_output(outputs, metrics)

    def _do_forward_backward(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        request = wire.parse_forward_backward(body)
        return self._forward_backward(self._model(model_id), request), PROTOBUF

    def _do_optim_step(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        model = self._model(model_id)
        metrics = model.core.optim_step(adam_params(json.loads(body).get("adam_params")))
        bad = model.core.nonfinite()
        if bad:
            _, _, snapshot = self.store.progress(model_id)
            if snapshot:
                registry.restore(model, torch.load(snapshot, map_location=self.device, weights_only=False))
            raise wire.WireError(f"the step made {', '.join(bad[:3])} non-finite; it was undone")
        model.core.version += 1
        return _json(metrics={f"{k}:mean": v for k, v in metrics.items()}), "application/json"

    def _named(self, body: bytes) -> tuple[dict[str, Any], str | None]:
        request = json.loads(body)
        name = request.get("path")
        if name is not None and not _NAME.match(str(name)):
            raise wire.WireError(
                f"checkpoint name {name!r}: use letters, digits, '_', '.', '-' (at most 128)"
            )
        return request, name

    def _do_save_weights(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
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
            path=self.tinker_path(model_id, "weights", name), type="save_weights"
        ), "application/json"

    def _do_save_weights_for_sampler(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        model = self._model(model_id)
        request, name = self._named(body)
        stored = name or f"ephemeral-{seq}"
        self._save(
            self._dir(model_id) / "sampler_weights" / f"{stored}.pt", self._state(model_id, optimizer=False)
        )
        path = self.tinker_path(model_id, "sampler_weights", stored)
        if isinstance(model, registry.PolicyModel):  # the rollouts act with it from now on
            version = (published_version(self.client, self.config.run.name) or 0) + 1
            publish_weights(self.client, self.config.run.name, version, model.core.weights(), model.core.spec,
                            signing_key("weights"))  # fmt: skip
            log.info("Tinker model %s published as policy version %d", model_id, version)
        if name is not None:
            return _json(path=path, type="save_weights_for_sampler"), "application/json"
        sampler = f"{model_id.split(':')[0]}:sample:{uuid.uuid4().hex[:12]}"
        self.store.add_sampler(sampler, model.base_model, path)
        return _json(
            path=path, sampling_session_id=sampler, type="save_weights_for_sampler"
        ), "application/json"

    def _do_unload_model(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        self.models.pop(model_id, None)
        self.store.unload_model(model_id)
        return _json(model_id=model_id, type="unload_model"), "application/json"

    def _sampler(self, sampler_id: str) -> registry.LanguageModel:
        found = self.store.sampler(sampler_id)
        if found is None:
            raise wire.WireError(f"no sampling session {sampler_id!r}")
        base_model, path = found
        if base_model not in registry.LANGUAGE_MODELS:
            raise wire.WireError(f"{base_model} is a control policy: it acts through the rollout services, and "
                                 "sample() only returns tokens")  # fmt: skip
        key = path or base_model
        if key not in self.samplers:
            if len(self.samplers) >= 4:
                self.samplers.pop(next(iter(self.samplers)))
            if path is None:
                model = registry.build(
                    base_model, {}, self.config.trainer.model, self.device, self.config.run.seed
                )
            else:
                state = torch.load(self.file_of(path), map_location=self.device, weights_only=False)
                model = registry.build(base_model, state["record"].get("lora") or {}, self.config.trainer.model,
                                       self.device, self.config.run.seed)  # fmt: skip
                model.load_model_state(state["model"])
            assert isinstance(model, registry.LanguageModel)
            self.samplers[key] = model
        return self.samplers[key]

    def _do_sample(self, model_id: str, seq: int, body: bytes) -> tuple[bytes, str]:
        request = json.loads(body)
        model = self._sampler(request.get("sampling_session_id") or "")
        prompt = [t for chunk in request["prompt"]["chunks"] for t in chunk.get("tokens", [])]
        params = request.get("sampling_params") or {}
        stop_tokens = _stop_tokens(params.get("stop"), model)
        try:
            sequences = tiny_lm.sample(
                model.core.model, prompt, max_tokens=int(params.get("max_tokens") or 16),
                temperature=float(params.get("temperature", 1.0)), top_k=int(params.get("top_k", -1)),
                top_p=float(params.get("top_p", 1.0)), stop_tokens=stop_tokens, seed=params.get("seed"),
                num_samples=int(request.get("num_samples", 1)))  # fmt: skip
        except ValueError as error:
            raise wire.WireError(str(error)) from None
        prompt_logprobs = (
            tiny_lm.prompt_logprobs(model.core.model, prompt) if request.get("prompt_logprobs") else None
        )
        return wire.sample_response(sequences, prompt_logprobs), PROTOBUF


def _stop_tokens(stop: Any, model: registry.LanguageModel) -> list[int]:
    """SamplingParams.stop as token ids: None keeps the end-of-sequence token; for the byte-level LM a one-byte
    string is that byte."""
    if stop is None:
        return [model.core.model.eos_id]
    stops = [stop] if isinstance(stop, str) else list(stop)
    if all(isinstance(s, int) for s in stops):
        return stops
    encoded = [tiny_lm.ByteTokenizer().encode(s) for s in stops if isinstance(s, str)]
    if (
        model.base_model != registry.TINY_LM
        or len(encoded) != len(stops)
        or any(len(e) != 1 for e in encoded)
    ):
        raise wire.WireError(
            "stop strings are served for the byte-level LM, one byte each; pass token ids instead"
        )
    return [e[0] for e in encoded]


def run_loss(model: registry.ServedModel, data: list[wire.Datum], loss_name: str, config: dict[str, float | str],
             forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:  # fmt: skip
    """Tinker's ``forward`` / ``forward_backward`` on a model: the loss summed over the data (its gradients added
    to the parameters' unless ``forward_only``), each datum's outputs and the loss metric."""
    compute = loss_fn(loss_name)
    if not data:
        raise wire.WireError("forward_backward with no data")
    with torch.set_grad_enabled(not forward_only):
        forward = model.forward(data, config)
        per_datum = registry.loss_inputs(data)
        loss = sum(compute(lp, {k: v.to(lp.device) for k, v in inputs.items()}, config)
                   for lp, inputs in zip(forward.logprobs, per_datum, strict=True))  # fmt: skip
        if forward.extra_loss is not None:
            loss = loss + forward.extra_loss
        if not forward_only:
            loss.backward()
    return forward.outputs, {"loss:sum": float(loss.detach())}


def adam_params(adam: Any) -> AdamParams:
    """The SDK's AdamParams (its defaults where a field is absent) as the training core's."""
    if not isinstance(adam, dict):
        raise wire.WireError("optim_step: this server runs Adam(W) only; send AdamParams")
    clip = float(adam.get("grad_clip_norm", 0.0))
    return AdamParams(learning_rate=float(adam.get("learning_rate", 1e-4)), beta1=float(adam.get("beta1", 0.9)),
                      beta2=float(adam.get("beta2", 0.95)), eps=float(adam.get("eps", 1e-12)),
                      weight_decay=float(adam.get("weight_decay", 0.0)), grad_clip_norm=clip if clip > 0 else None)  # fmt: skip
