"""What every route of the Tinker API shares: the ``Api`` dependency (the store, the served models, the limits,
the long polls' waiters), the HTTP error it raises, and how a body is read. A route reaches the worker only through
the store: it queues a request there, or reads what the worker wrote, always through ``Api.redis`` (its threads,
never the event loop: while Redis hangs, health checks answer and a route that needs Redis answers 503).

A body is bounded by what reading it builds, not only by its bytes (``max_request_mb``): a JSON body's values
are counted before it is parsed (``json_values``; a Protobuf one's fields, ``wire.count_fields``), and a body
larger than ``bodies.INLINE_BYTES`` is parsed and validated in a thread, ``PARSERS`` at a time, so that the event loop
(health checks, long polls, every other client) never waits for it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from tinker_atropos.frontends.bodies import MAX_ERRORS, OffLoop, separators
from tinker_atropos.frontends.http import RedisCalls
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.tinker_api import base_models, wire
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.training.served import LANGUAGE_MODELS

NUMBERED = (
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "save_weights_external",
)
OWNER = "tinker-atropos"  # the runs of one server share its API keys: no owner of their own
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
JSON_VALUES = 4096  # values a JSON body may hold (a sample's prompt tokens besides): no request needs more
PARSERS = 2  # threads reading large bodies at once: more would only share the same cores
# threads making the routes' Redis calls: each takes a fraction of a millisecond, so a few keep up with hundreds of
# clients, and no more than these wait on a Redis that hangs
REDIS_THREADS = 8
T = TypeVar("T")


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Waiters:
    """Wakes the long polls of a request when its outcome is stored (``Requests.finished``, from the worker's
    thread)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: dict[str, asyncio.Event] = {}

    def event(self, request_id: str) -> asyncio.Event:
        self.loop = asyncio.get_running_loop()
        return self.events.setdefault(request_id, asyncio.Event())

    def done(self, request_id: str) -> None:
        event, loop = self.events.get(request_id), self.loop
        if event is not None and loop is not None:
            loop.call_soon_threadsafe(event.set)


def json_values(body: bytes, max_values: int = JSON_VALUES) -> None:
    """HTTPError 400 when a JSON body holds more than ``max_values`` values, counted by their separators (commas
    and opening brackets, those in strings too) before anything is parsed: what parsing and validation build
    grows with the values, not the bytes (2 MiB of integers where strings belong made 1M validation errors,
    700 MB and 5 s)."""
    values = sum(separators(body))
    if values > max_values:
        raise HTTPError(
            400,
            f"the body holds about {values} JSON values (counted by commas and brackets); a "
            f"request to this route holds at most {max_values}",
        )


def parse_body(model: type[BaseModel], body: bytes, max_values: int = JSON_VALUES) -> Any:
    """The body validated as ``model``; HTTPError 400 naming its first ``MAX_ERRORS`` problems."""
    json_values(body, max_values)
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
            for e in error.errors(include_url=False, include_input=False)[:MAX_ERRORS]
        )
        raise HTTPError(
            400, f"invalid {model.__name__}: {problems} ({error.error_count()} problems)"
        ) from None


def json_object(body: bytes, expected: str, empty: bytes = b"{}") -> dict[str, Any]:
    """A JSON object's body (``empty`` when there is none); HTTPError 400 saying what was ``expected``."""
    json_values(body)
    try:
        found = json.loads(body or empty)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise HTTPError(400, f"the body must be {expected}")
    return found


_MODEL_ID = re.compile(rb'"model_id"\s*:\s*"([^"\\]{1,512})"')
_SEQ_ID = re.compile(rb'"seq_id"\s*:\s*(\d{1,18})(?![\d.eE])')


def numbered(route: str, body: bytes) -> tuple[str, int] | None:
    """The (model, number) a numbered request's body names, as far as it (or its first bytes) tells; None for
    another route, or a body that does not say. A JSON body with too many values to parse is searched for them."""
    if route == "forward_backward":
        model_id, seq = wire.leading_fields(body)
    elif route in NUMBERED:
        try:
            json_values(body)
            fields = json.loads(body)  # Python's parser: a NaN in AdamParams does not hide the number
        except HTTPError:
            found_model, found_seq = _MODEL_ID.search(body), _SEQ_ID.search(body)
            fields = {
                "model_id": found_model and found_model[1].decode(errors="replace"),
                "seq_id": found_seq and int(found_seq[1]),
            }
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
    """What the routes share: the store (reached through ``redis``), the served models, the limits and the long
    polls' waiters."""

    store: Store
    capabilities: list[base_models.Capability]
    long_poll_s: float
    max_request_bytes: int
    max_request_tokens: int
    max_queued_requests: int = 256  # trainer.tinker.max_queued_requests: per session, per model
    waiters: Waiters = field(default_factory=Waiters)
    # the requests answered 401 (no key, a wrong one): counted and logged, nothing else
    parsers: OffLoop = field(default_factory=lambda: OffLoop(PARSERS))
    redis: RedisCalls = field(default_factory=lambda: RedisCalls("tinker-api-redis", REDIS_THREADS))
    unauthenticated: CountedWarnings = field(
        default_factory=lambda: CountedWarnings(
            "Tinker API requests refused without an allowed API key (401)"
        )
    )

    async def refused(self, scope: Scope, body: bytes, reason: str) -> None:
        """A numbered request of a client that proved its key, refused before it was queued: its number noted,
        to be answered as failed. (A client without a key never gets here: ``APIKeys`` refuses it first.)"""
        found = await self.off_loop(body, numbered, scope["path"].removeprefix("/api/v1/"), body)
        if found is not None:
            await self.redis(self.store.requests.refuse, *found, reason)

    async def off_loop(self, body: bytes, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)``, reading ``body``, off the event loop when the body is large (``bodies.OffLoop``)."""
        return await self.parsers.run(body, work, *args)

    async def parse(self, model: type[BaseModel], body: bytes, max_values: int = JSON_VALUES) -> Any:
        """The body validated as ``model`` (``parse_body``), off the event loop when it is large."""
        return await self.off_loop(body, parse_body, model, body, max_values)

    async def json(self, body: bytes, expected: str) -> dict[str, Any]:
        """A JSON object's body (``json_object``), off the event loop when it is large."""
        return await self.off_loop(body, json_object, body, expected)

    def budget(self) -> wire.Budget:
        """What a request's arrays may take once densified (``wire.request_budget``), fresh for each request."""
        return wire.request_budget(self.max_request_bytes)

    def queued(self, request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"request_id": request_id, "model_id": model_id, **extra}

    async def known_model(self, model_id: str, loaded: bool = True) -> dict[str, Any]:
        """The model's record; 404 for no such model, or (``loaded``) one unloaded since (its session ended)."""
        record, is_loaded = await self.redis(self.store.models.record_if_loaded, model_id)
        if record is None:
            raise HTTPError(404, f"no model {model_id!r}")
        if loaded and not is_loaded:
            raise HTTPError(404, f"model {model_id!r} was unloaded (unload_model, or its session finished)")
        return record

    async def within_queue(self, model_id: str, seq_id: int) -> None:
        """429 for a numbered request more than ``max_queued_requests`` past the model's last one applied: a
        client's queue of training requests is bounded as its samples are (the SDK retries it later)."""
        applied = (await self.redis(self.store.models.progress, model_id))[0]
        if seq_id - applied > self.max_queued_requests:
            raise HTTPError(
                429,
                f"request {seq_id} of model {model_id!r} is {seq_id - applied} past the last one applied; "
                f"{self.max_queued_requests} may wait (trainer.tinker.max_queued_requests)",
            )

    async def session(self, session_id: str) -> None:
        """404 for no such session, 410 for a finished one (as the SDK's heartbeat expects)."""
        state = await self.redis(self.store.sessions.state, session_id)
        if state is None:
            raise HTTPError(404, f"no session {session_id!r}")
        if state:
            raise HTTPError(410, f"session {session_id!r} is finished ({state})")

    def served(self, base_model: str | None) -> str:
        """``base_model`` when this server lists it (``get_server_capabilities``); 400 naming those it lists
        otherwise: no other name reaches the worker, and no part of one reaches an import."""
        names = [c.name for c in self.capabilities]
        if base_model not in names:
            raise HTTPError(400, str(base_models.unknown(base_model, names)))
        return base_model

    async def checkpoint_record(self, path: str) -> dict[str, Any]:
        """The record of the checkpoint behind a ``tinker://`` path, read in the thread pool; 404 for none."""
        try:
            return await run_in_threadpool(self.store.files.record, path)
        except wire.WireError as error:
            raise HTTPError(404, str(error)) from None


async def _api(request: Request) -> Api:  # async: FastAPI runs a plain def dependency in its thread pool
    return request.app.state.api


Shared = Annotated[Api, Depends(_api)]


def add_model(store: Store, model_id: str, record: dict[str, Any], kind: str, body: bytes) -> str:
    """A model registered and its request number 0 (``kind``: how it is made) queued; the request's id."""
    store.models.add(model_id, record)
    return store.requests.submit(kind, body, model_id, seq=0)


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
