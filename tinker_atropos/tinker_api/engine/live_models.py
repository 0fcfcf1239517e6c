"""The models the worker serves, live in its memory, and their lifecycle: each built on ``create_model`` (within
``trainer.tinker.max_models``, ``max_adapters_per_base`` and ``max_models_mb``, checked before it is held), or from
a checkpoint, loaded with a checkpoint's weights, rebuilt from a restarted worker's snapshot, and unloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tinker_atropos.config import Config, TinkerSection
from tinker_atropos.tinker_api import base_models, wire
from tinker_atropos.tinker_api.engine.responses import JSON, Response, json_body
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.queue import FAILED
from tinker_atropos.training.served import (
    LanguageModel,
    ServedModel,
    checkpoint,
    owned_bytes,
    shared_bytes,
)


def admit(record: dict[str, Any], models: Mapping[str, ServedModel], settings: TinkerSection) -> None:
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


def fits(model: ServedModel, models: Mapping[str, ServedModel], limit: float | None) -> None:
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


class ServedModels(Mapping[str, ServedModel]):
    """The live models by id, read as a mapping (the dispatcher groups by them, the expiry finds their sessions),
    and the handlers that create, load and unload them; a model is only touched by its lane's thread."""

    def __init__(self, store: Store, config: Config, checkpoints: Checkpoints, device: torch.device) -> None:
        self.store, self.config, self.checkpoints, self.device = store, config, checkpoints, device
        self.live: dict[str, ServedModel] = {}

    def __getitem__(self, model_id: str) -> ServedModel:
        return self.live[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.live)

    def __len__(self) -> int:
        return len(self.live)

    def loaded(self, model_id: str) -> ServedModel:
        """The model a request acts on; the client's error when it is not loaded."""
        model = self.live.get(model_id)
        if model is None:
            raise wire.WireError(f"model {model_id!r} is not loaded")
        return model

    def state(self, model_id: str, optimizer: bool = True) -> dict[str, Any]:
        """What a checkpoint or a snapshot of the model holds (its optimizer too, unless for sampling)."""
        return checkpoint(self.live[model_id], self.store.models.record(model_id), optimizer)

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
        self.live[model_id] = model

    def create_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        record, settings = self.store.models.record(model_id) or {}, self.config.trainer.tinker
        admit(record, self, settings)
        model = self.build(record)
        fits(model, self, settings.max_models_mb)
        self.live[model_id] = model
        return json_body(model_id=model_id, type="create_model"), JSON

    def create_from_state(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
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
            self.live.pop(model_id)
            raise
        return json_body(path=request["path"], model_id=model_id, type="load_weights"), JSON

    def load_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        request = json.loads(body)
        self.loaded(model_id)
        self._load(model_id, request["path"], bool(request.get("optimizer")))
        return json_body(path=request["path"], model_id=model_id, type="load_weights"), JSON

    def _load(self, model_id: str, path: str, optimizer: bool) -> None:
        state = torch.load(self.store.files.file_of(path), map_location=self.device, weights_only=True)
        model = self.live[model_id]
        if state["record"]["base_model"] != model.base_model:
            raise wire.WireError(f"{path} holds a {state['record']['base_model']}, not a {model.base_model}")
        if optimizer and "optimizer" not in state:
            raise wire.WireError(f"{path} holds no optimizer state (it was saved for sampling)")
        model.load_state_dict(state, optimizer)

    def unload_model(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        """Unload the model; a request of it still waiting (behind a number that never came) fails, saying so.
        Its snapshot goes: no request can run on it any more, and a restart rebuilds only loaded models."""
        self.live.pop(model_id, None)
        self.store.models.unload(model_id)
        self.checkpoints.unloaded(model_id)
        reason = json_body(
            error=f"model {model_id!r} was unloaded (unload_model, or its session finished) before this "
            "request could run",
            category="user",
        )
        # the model's lane runs this alone: the number the store holds as applied is the worker's last
        applied = self.store.models.progress(model_id)[0]
        for request_id in self.store.requests.waiting(model_id, after=applied):
            self.store.requests.finish(request_id, FAILED, reason, JSON)
        return json_body(model_id=model_id, type="unload_model"), JSON
