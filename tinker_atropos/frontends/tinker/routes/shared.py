"""What every route of the Tinker API shares: the ``Api`` dependency (store, worker, served models, limits, the
long polls' waiters), the HTTP error it raises, and how a body is read."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from tinker_atropos.frontends.tinker import base_models, wire
from tinker_atropos.frontends.tinker.store import Store
from tinker_atropos.frontends.tinker.worker import Worker
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.training.served import LANGUAGE_MODELS

NUMBERED = ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "load_weights",
            "save_weights_external")  # fmt: skip
OWNER = "tinker-atropos"  # the runs of one server share its API keys: no owner of their own
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Waiters:
    """Wakes the long polls of a request when the worker (another thread) finishes it."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: dict[str, asyncio.Event] = {}

    def event(self, request_id: str) -> asyncio.Event:
        self.loop = asyncio.get_running_loop()
        return self.events.setdefault(request_id, asyncio.Event())

    def done(self, request_id: str) -> None:  # from the worker's thread
        event, loop = self.events.get(request_id), self.loop
        if event is not None and loop is not None:
            loop.call_soon_threadsafe(event.set)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()[:5]
        )
        raise HTTPError(400, f"invalid {model.__name__}: {problems}") from None


def numbered(route: str, body: bytes) -> tuple[str, int] | None:
    """The (model, number) a numbered request's body names, as far as it (or its first bytes) tells; None for
    another route, or a body that does not say."""
    if route == "forward_backward":
        model_id, seq = wire.leading_fields(body)
    elif route in NUMBERED:
        try:
            fields = json.loads(body)  # Python's parser: a NaN in AdamParams does not hide the number
        except ValueError:
            return None
        model_id, seq = (
            (fields.get("model_id"), fields.get("seq_id")) if isinstance(fields, dict) else (None, None)
        )
    else:
        return None
    if isinstance(model_id, str) and type(seq) is int and seq >= 1:
        return model_id, seq
    return None


@dataclass
class Api:
    """What the routes share: the store, the worker, the served models, the limits and the long polls' waiters."""

    store: Store
    worker: Worker
    capabilities: list[base_models.Capability]
    long_poll_s: float
    max_request_bytes: int
    max_request_tokens: int
    waiters: Waiters = field(default_factory=Waiters)
    # the requests answered 401 (no key, a wrong one): counted and logged, nothing else
    unauthenticated: CountedWarnings = field(
        default_factory=lambda: CountedWarnings(
            "Tinker API requests refused without an allowed API key (401)"
        )
    )

    async def refused(self, scope: Scope, body: bytes, reason: str) -> None:
        """A numbered request refused before it was queued: its number noted, to be answered as failed."""
        found = numbered(scope["path"].removeprefix("/api/v1/"), body)
        if found is not None and self.store.refuse(*found, reason):
            self.worker.wake.set()

    def queued(self, request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        self.worker.wake.set()
        return {"request_id": request_id, "model_id": model_id, **extra}

    def known_model(self, model_id: str, loaded: bool = True) -> dict[str, Any]:
        """The model's record; 404 for no such model, or (``loaded``) one unloaded since (its session ended)."""
        record, is_loaded = self.store.model_if_loaded(model_id)
        if record is None:
            raise HTTPError(404, f"no model {model_id!r}")
        if loaded and not is_loaded:
            raise HTTPError(404, f"model {model_id!r} was unloaded (unload_model, or its session finished)")
        return record

    def session(self, session_id: str) -> None:
        """404 for no such session, 410 for a finished one (as the SDK's heartbeat expects)."""
        state = self.store.session_state(session_id)
        if state is None:
            raise HTTPError(404, f"no session {session_id!r}")
        if state:
            raise HTTPError(410, f"session {session_id!r} is finished ({state})")

    async def checkpoint_record(self, path: str) -> dict[str, Any]:
        """The record of the checkpoint behind a ``tinker://`` path, read in the thread pool; 404 for none."""
        try:
            return await run_in_threadpool(self.worker.checkpoints.record, path)
        except wire.WireError as error:
            raise HTTPError(404, str(error)) from None


async def _api(request: Request) -> Api:  # async: FastAPI runs a plain def dependency in its thread pool
    return request.app.state.api


Shared = Annotated[Api, Depends(_api)]


def metadata_strings(user_metadata: dict[str, Any] | None) -> dict[str, str]:
    """A run's ``user_metadata`` as the SDK's TrainingRun carries it: strings."""
    return {str(key): str(value) for key, value in (user_metadata or {}).items()}


def iso(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, UTC).isoformat()


def lora_of(record: dict[str, Any]) -> dict[str, Any]:
    """``is_lora`` and ``lora_rank`` of a model's record: a language model of rank > 0 (a control policy trains
    fully, whatever rank it was asked for)."""
    rank = int((record.get("lora") or {}).get("rank", 0))
    is_lora = record["base_model"] in LANGUAGE_MODELS and rank > 0
    return {"is_lora": is_lora, "lora_rank": rank if is_lora else None}
