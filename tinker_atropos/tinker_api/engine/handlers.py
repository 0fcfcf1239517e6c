"""What each kind of queued Tinker request does to the models served: build one (fresh or from a checkpoint),
load weights, accumulate gradients, take an optimizer step, save, sample. Each handler takes the request's model,
number, body and deadline, and returns the response's body and content type; a ``ClientError`` it raises is the
client's error."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import torch

from tinker_atropos.config import Config, TinkerSection
from tinker_atropos.security import signing_key
from tinker_atropos.state.weights import publish_weights
from tinker_atropos.tinker_api import base_models, wire
from tinker_atropos.tinker_api.engine.sampling_process import Interrupted, Job, SamplingProcess
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.files import EPHEMERAL, named, parts, tinker_path
from tinker_atropos.tinker_api.store.sequences import Record
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import (
    LANGUAGE_MODELS,
    LanguageModel,
    LossRun,
    PolicyModel,
    ServedModel,
    checkpoint,
    owned_bytes,
    run_loss,
    run_losses,
    shared_bytes,
)

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
Handler = Callable[[str, int, bytes, float], tuple[bytes, str]]


def json_body(**fields: Any) -> bytes:
    """A JSON response's body."""
    return json.dumps(fields).encode()


def admit(record: dict[str, Any], models: dict[str, ServedModel], settings: TinkerSection) -> None:
    """WireError when a model of ``record`` beside ``models`` would pass their number (``max_models``) or its
    base's LoRA adapters (``max_adapters_per_base``): checked before it is built."""
    if len(models) >= settings.max_models:
        raise wire.WireError(
            f"{len(models)} models are loaded, the most this server holds "
            "(trainer.tinker.max_models); finish a session or unload a model"
        )
    base = record.get("base_model")
    if int((record.get("lora") or {}).get("rank") or 0) > 0:
        adapters = sum(
            isinstance(m, LanguageModel) and m.lora and m.base_model == base for m in models.values()
        )
        if adapters >= settings.max_adapters_per_base:
            raise wire.WireError(
                f"{adapters} LoRA models of {base} are loaded, the most this server holds of one base "
                "(trainer.tinker.max_adapters_per_base); finish a session or unload a model"
            )


def fits(model: ServedModel, models: dict[str, ServedModel], limit: float | None) -> None:
    """WireError when ``model`` (built, not yet held) takes ``models`` past ``limit`` MB
    (``trainer.tinker.max_models_mb``)."""
    if limit is None:
        return
    total = (shared_bytes() + sum(owned_bytes(m) for m in models.values()) + owned_bytes(model)) / 1e6
    if total > limit:
        raise wire.WireError(
            f"a {model.base_model} model would take the models to {total:,.0f} MB, past the {limit:,.0f} MB "
            "this server holds (trainer.tinker.max_models_mb); finish a session, unload a model, or use LoRA "
            "(its models share the base)"
        )


class RequestHandlers:
    """The models served, and the handler of each kind of request that acts on them (run by their lane's thread)."""

    def __init__(
        self,
        store: Store,
        client: redis.Redis,
        config: Config,
        checkpoints: Checkpoints,
        sampling: SamplingProcess,
        guard: NonfiniteGuard,
        stopping: threading.Event,
        device: torch.device,
    ) -> None:
        self.store, self.client, self.config, self.checkpoints = store, client, config, checkpoints
        self.sampling, self.guard, self.stopping, self.device = sampling, guard, stopping, device
        self.models: dict[str, ServedModel] = {}
        self.stability = Record(client, store.run)  # what samplers recorded for stable_reinforce

    def budget(self) -> wire.Budget:
        return wire.request_budget(int(self.config.trainer.tinker.max_request_mb * 2**20))

    def model(self, model_id: str) -> ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise wire.WireError(f"model {model_id!r} is not loaded")
        return model

    def state(self, model_id: str, optimizer: bool = True) -> dict[str, Any]:
        return checkpoint(self.models[model_id], self.store.models.record(model_id), optimizer)

    def build(self, record: dict[str, Any]) -> ServedModel:
        lora = record.get("lora") or {}
        seed = lora.get("seed") if lora.get("seed") is not None else self.config.run.seed
        return base_models.build(
            record["base_model"], lora, self.config.trainer.model, self.device, seed, self.config.env.id
        )

    def restore(self, model_id: str, record: dict[str, Any], snapshot: str) -> None:
        """The model rebuilt from its snapshot (a restarted worker's)."""
        model = self.build(record)
        model.load_state_dict(torch.load(snapshot, map_location=self.device, weights_only=True))
        self.models[model_id] = model

    def create_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        record, settings = self.store.models.record(model_id) or {}, self.config.trainer.tinker
        admit(record, self.models, settings)
        model = self.build(record)
        fits(model, self.models, settings.max_models_mb)
        self.models[model_id] = model
        return json_body(model_id=model_id, type="create_model"), JSON

    def _load(self, model_id: str, path: str, optimizer: bool) -> None:
        state = torch.load(self.store.files.file_of(path), map_location=self.device, weights_only=True)
        model = self.models[model_id]
        if state["record"]["base_model"] != model.base_model:
            raise wire.WireError(f"{path} holds a {state['record']['base_model']}, not a {model.base_model}")
        if optimizer and "optimizer" not in state:
            raise wire.WireError(f"{path} holds no optimizer state (it was saved for sampling)")
        model.load_state_dict(state, optimizer)

    def create_from_state(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        request = json.loads(body)
        # the checkpoint's model (base, LoRA) in this session, with the user metadata this run was created with
        created = self.store.models.record(model_id) or {}
        record = {
            **self.store.files.record(request["path"]),
            "session": model_id.split(":")[0],
            "user_metadata": created.get("user_metadata") or {},
        }
        self.store.models.update(model_id, record)
        self.create_model(model_id, seq, b"", deadline)
        try:
            self._load(model_id, request["path"], bool(request.get("optimizer")))
        except Exception:
            self.models.pop(model_id)
            raise
        return json_body(path=request["path"], model_id=model_id, type="load_weights"), JSON

    def load_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        request = json.loads(body)
        self.model(model_id)
        self._load(model_id, request["path"], bool(request.get("optimizer")))
        return json_body(path=request["path"], model_id=model_id, type="load_weights"), JSON

    def apply_forward_backward(
        self, model_id: str, request: wire.ForwardBackward, deadline: float | None
    ) -> bytes:
        """A forward_backward as applied, or replayed after a restart (the samplers' record is in Redis)."""
        if request.loss_fn == "stable_reinforce":
            self.stability.look_up(model_id, request)
        outputs, metrics = run_loss(
            self.model(model_id),
            request.data,
            request.loss_fn,
            request.loss_fn_config,
            request.forward_only,
            self._time_check(deadline),
        )
        return wire.forward_backward_output(outputs, metrics)

    def forward_backward(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        request = wire.parse_forward_backward(body, self.budget())
        return self.apply_forward_backward(model_id, request, deadline), PROTOBUF

    def forward_backward_together(
        self, requests: list[tuple[str, bytes]], deadline: float
    ) -> list[tuple[bytes, str] | Exception]:
        """The ``forward_backward`` (or forward) requests, given as (model, body), of LoRA models of one base and
        one adapter layout, in one batched pass (``run_losses``); per request, its response or the error it alone
        failed with, its model untouched."""
        outcomes: list[tuple[bytes, str] | Exception | None] = [None] * len(requests)
        runs, ran = [], []
        for index, (model_id, body) in enumerate(requests):
            try:
                request = wire.parse_forward_backward(body, self.budget())
                if request.loss_fn == "stable_reinforce":
                    self.stability.look_up(model_id, request)
                model = self.model(model_id)
            except Exception as error:  # this request's alone: a body, a model, a sampler record
                outcomes[index] = error
                continue
            assert isinstance(model, LanguageModel)  # the dispatcher groups LoRA language models only
            runs.append(
                LossRun(
                    model,
                    request.data,
                    request.loss_fn,
                    request.loss_fn_config,
                    request.forward_only,
                    self._time_check(deadline),
                )
            )
            ran.append(index)
        for index, outcome in zip(ran, run_losses(runs) if runs else [], strict=True):
            outcomes[index] = (
                outcome
                if isinstance(outcome, Exception)
                else (wire.forward_backward_output(*outcome), PROTOBUF)
            )
        return outcomes  # type: ignore[return-value]  # every request has its outcome by now

    def _time_check(self, deadline: float | None) -> Callable[[], None]:
        """What a request calls between its steps: it ends the request past its time budget, or when the
        worker stops (the request then runs again after the restart)."""
        limit = self.config.trainer.tinker.max_request_s

        def check() -> None:
            if self.stopping.is_set():
                raise Interrupted
            if deadline is not None and time.monotonic() > deadline:
                raise wire.WireError(
                    f"the request ran past its time budget of {limit:g} s "
                    "(trainer.tinker.max_request_s); ask for less work per request"
                )

        return check

    def optim_step(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        model = self.model(model_id)
        adam = adam_params(json.loads(body).get("adam_params"))
        metrics, bad = self.guard.update(model.core, None, lambda: model.core.optim_step(adam))
        if bad:
            raise wire.WireError(f"the step made {', '.join(bad[:3])} non-finite; it was undone")
        return json_body(metrics={f"{k}:mean": v for k, v in metrics.items()}), JSON

    def save_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        self.model(model_id)
        request = json.loads(body)
        name = named(request) or f"step-{seq}"
        file = self.store.files.file(model_id, "weights", name)
        if file.exists() and not request.get("overwrite"):
            raise wire.WireError(
                f"checkpoint {name!r} exists; save under another name or pass overwrite=True"
            )
        self.checkpoints.save(file, self.state(model_id))
        return json_body(
            path=self.checkpoints.saved(model_id, "weights", name, request), type="save_weights"
        ), JSON

    def save_weights_for_sampler(
        self, model_id: str, seq: int, body: bytes, deadline: float
    ) -> tuple[bytes, str]:
        model = self.model(model_id)
        request = json.loads(body)
        name = named(request)
        stored = name or f"{EPHEMERAL}{seq}"
        self.checkpoints.save(
            self.store.files.file(model_id, "sampler_weights", stored), self.state(model_id, optimizer=False)
        )
        path = tinker_path(model_id, "sampler_weights", stored)
        if name is None:  # kept while its sampling client samples
            self.checkpoints.keep_ephemeral(path)
        if isinstance(model, PolicyModel):  # the rollouts act with it from now on
            version = publish_weights(
                self.client,
                self.config.run.name,
                1,
                model.core.weights(),
                model.core.spec,
                signing_key("weights"),
            )
            log.info("Tinker model %s published as policy version %d", model_id, version)
        if name is not None:
            self.checkpoints.saved(model_id, "sampler_weights", name, request)
            return json_body(path=path, type="save_weights_for_sampler"), JSON
        sampler = f"{model_id.split(':')[0]}:sample:{uuid.uuid4().hex[:12]}"
        self.store.samplers.add(sampler, model.base_model, path)
        return json_body(path=path, sampling_session_id=sampler, type="save_weights_for_sampler"), JSON

    def save_weights_external(
        self, model_id: str, seq: int, body: bytes, deadline: float
    ) -> tuple[bytes, str]:
        """Weights for transformers and PEFT, on the trainer's disk (``tinker_api/engine/weights_out.py``)."""
        path, size = self.checkpoints.save_external(model_id, self.model(model_id), json.loads(body))
        return json_body(path=path, size_bytes=size, type="save_weights_external"), JSON

    def sample(self, model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
        """Sampled in the sampling process, from the sampler this request's session names."""
        sampler_id = json.loads(body).get("sampling_session_id") or ""
        found = self.store.samplers.get(sampler_id)
        if found is None:
            raise wire.WireError(f"no sampling session {sampler_id!r}")
        base_model, path = found
        if base_model not in LANGUAGE_MODELS:
            raise wire.WireError(
                f"{base_model} is a control policy: it acts through the rollout services, and "
                "sample() only returns tokens"
            )
        file = str(self.store.files.file_of(path)) if path is not None else None
        if path is not None and parts(path)[2].startswith(EPHEMERAL):
            self.checkpoints.keep_ephemeral(path)
        if self.stopping.is_set():
            raise Interrupted
        budget = self.config.trainer.tinker.max_request_s
        tenant = sampler_id.split(":")[
            0
        ]  # the session that made the sampler (routes/sampling.py names it so)
        outcome = self.sampling.run(Job(path or base_model, base_model, file, body, deadline, budget, tenant))
        if outcome.status == "done":
            return outcome.body, outcome.content_type
        error = json.loads(outcome.body)["error"]
        raise wire.WireError(error) if outcome.status == "user" else RuntimeError(error)


def refused(model_id: str, seq: int, body: bytes, deadline: float) -> tuple[bytes, str]:
    """A numbered request the API refused: answered as failed, with the reason it was refused for."""
    raise wire.WireError(body.decode(errors="replace"))


def adam_params(adam: Any) -> AdamParams:
    """The SDK's AdamParams (its defaults where a field is absent) as the training core's; WireError for a value
    no step can be taken with (a NaN learning rate, a beta of 1)."""
    if not isinstance(adam, dict):
        raise wire.WireError("optim_step: this server runs Adam(W) only; send AdamParams")
    defaults = {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    values = {}
    for name, default in defaults.items():
        value = adam.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wire.WireError(f"AdamParams.{name} must be a finite number, got {value!r}")
        values[name] = float(value)
    bounds = {
        "learning_rate": values["learning_rate"] >= 0,
        "beta1": 0 <= values["beta1"] < 1,
        "beta2": 0 <= values["beta2"] < 1,
        "eps": values["eps"] > 0,
        "weight_decay": values["weight_decay"] >= 0,
        "grad_clip_norm": values["grad_clip_norm"] >= 0,
    }
    wrong = [name for name, holds in bounds.items() if not holds]
    if wrong:
        raise wire.WireError(
            f"AdamParams out of range: {', '.join(f'{n}={values[n]}' for n in wrong)} (learning "
            "rate, weight decay and clip norm >= 0, betas in [0, 1), eps > 0)"
        )
    clip = values["grad_clip_norm"]
    return AdamParams(
        learning_rate=values["learning_rate"],
        beta1=values["beta1"],
        beta2=values["beta2"],
        eps=values["eps"],
        weight_decay=values["weight_decay"],
        grad_clip_norm=clip if clip > 0 else None,
    )
