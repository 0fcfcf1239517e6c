"""The Tinker HTTP API: what the official SDK calls, answered from the store, with the work queued for the
worker. Every route needs an allowed API key in ``X-API-Key`` (unless the run is ``--insecure``); a request the SDK
would not send gets a status and a message, and the server goes on serving everyone else.

One router per resource (sessions and models; training requests and their futures; sampling; the training runs and
checkpoints of the SDK's ``RestClient``; the service itself), each route reaching the store and the worker through
the ``Api`` dependency. A route that reads a file does so in the thread pool, never on the event loop.

A numbered request (``forward_backward``, ``optim_step``, ``save_weights[_for_sampler]``, ``load_weights``) refused
here, by its body, its size or its key, is noted as refused with its number (``Store.refuse``): the SDK has used
that number, so once its next one arrives the worker answers the refused one as failed and the model goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope
from tinker import types

from tinker_atropos.frontends.http import APIKeys, BodyLimit
from tinker_atropos.frontends.tinker import registry, wire
from tinker_atropos.frontends.tinker.checkpoints import tinker_path
from tinker_atropos.frontends.tinker.stability import sequence_ids
from tinker_atropos.frontends.tinker.store import PENDING, Store, sampler_lane
from tinker_atropos.frontends.tinker.worker import Worker
from tinker_atropos.training.served import LANGUAGE_MODELS

NUMBERED = ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "load_weights",
            "save_weights_external")  # fmt: skip
# the SDK's calls this server refuses, each with a 404 that says why (a 404 because the SDK retries a 501)
UNSERVED = {
    ("POST", "/api/v1/save_weights_external"): "save_weights_external: weights are not exported outside this "
    "trainer's run folder; use save_state or save_weights_for_sampler",
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls"): "external "
    "weights: none are saved here (save_weights_external is refused)",
    ("POST", "/api/v1/copy_weights"): "copy_weights: checkpoints stay in the run folder that saved them",
    ("POST", "/api/v1/join_sampling_session"): "join_sampling_session: create a sampling client instead",
    ("POST", "/api/v1/create_custom_loss"): "server-side custom losses: forward_backward_custom runs on the "
    "client, over cross_entropy",
    ("POST", "/api/v1/cancel_future"): "cancel_future: a queued request runs, and its result expires",
    (
        "GET",
        "/api/v1/sessions",
    ): "session listing (and search, projects, trace export): sessions are internal",
    ("GET", "/api/v1/audit"): "the audit log: this server keeps no accounts",
}
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


def _parse(model: type[BaseModel], body: bytes) -> Any:
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
    capabilities: list[registry.Capability]
    long_poll_s: float
    max_request_bytes: int
    max_request_tokens: int
    waiters: Waiters = field(default_factory=Waiters)

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


# the service: client configuration, health, capabilities, and the calls refused ------------------------------
service = APIRouter()


@service.post("/client/config")
async def client_config(api: Shared) -> dict[str, Any]:
    return {
        "pjwt_auth_enabled": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "use_pyqwest_transport": False,
        # the SDK splits a forward_backward's data into requests of at most this many (estimated) bytes: below
        # the body limit, with room for what its estimate leaves out
        "fwdbwd_max_chunk_bytes_count": api.max_request_bytes * 3 // 4,
    }


@service.post("/client/dynamic_config")
async def dynamic_config() -> dict[str, Any]:
    return {}


@service.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@service.get("/get_server_capabilities")
async def server_capabilities(api: Shared) -> dict[str, Any]:
    return {"supported_models": [{"model_name": c.name, "trainable": c.trainable, "sampleable": c.sampleable,
                                  "max_context_length": c.max_context_length} for c in api.capabilities]}  # fmt: skip


@service.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}  # the SDK's own telemetry: nothing here consumes it


def _unserved(reason: str) -> Callable[[Request, Api], Awaitable[None]]:
    async def route(request: Request, api: Shared) -> None:
        await api.refused(request.scope, await request.body(), f"refused (404): {reason}")
        raise HTTPError(404, f"not served by this trainer: {reason}")

    return route


for (_method, _path), _reason in UNSERVED.items():
    service.add_api_route(_path.removeprefix("/api/v1"), _unserved(_reason), methods=[_method])


# sessions and models -----------------------------------------------------------------------------------------
sessions = APIRouter()


@sessions.post("/create_session")
async def create_session(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.CreateSessionRequest, await request.body())
    session_id = api.store.create_session({"sdk_version": body.sdk_version, "tags": body.tags,
                                           "user_metadata": body.user_metadata})  # fmt: skip
    return {"type": "create_session", "session_id": session_id}


@sessions.post("/session_heartbeat")
async def heartbeat(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.SessionHeartbeatRequest, await request.body())
    if not api.store.heartbeat(body.session_id):
        raise HTTPError(410, f"session {body.session_id!r} is unknown or finished")
    return {"type": "session_heartbeat"}


@sessions.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, api: Shared) -> None:
    if api.store.session_state(session_id) is None:
        raise HTTPError(404, f"no session {session_id!r}")
    try:
        body = json.loads(await request.body() or b"{}")
        reason = body.get("reason") or {"type": "finished"}
        kind = reason["type"]
        if not isinstance(kind, str):
            raise TypeError(kind)
    except (ValueError, AttributeError, KeyError, TypeError):
        raise HTTPError(400, 'the body must be {"reason": {"type": "success" | "errored" | ...}}') from None
    for model_id in api.store.finish_session(session_id, kind):
        api.store.submit("unload_model", b"", model_id=model_id)
    api.worker.wake.set()


@sessions.post("/create_model")
async def create_model(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.CreateModelRequest, await request.body())
    api.session(body.session_id)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    lora = body.lora_config.model_dump() if body.lora_config else {}
    record = {
        "base_model": body.base_model,
        "lora": lora,
        "session": body.session_id,
        "created_at": time.time(),
        "user_metadata": _metadata(body.user_metadata),
    }
    api.store.add_model(model_id, record)
    return api.queued(api.store.submit("create_model", b"", model_id, seq=0), model_id)


@sessions.post("/get_info")
async def get_info(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.GetInfoRequest, await request.body())
    record = api.known_model(body.model_id, loaded=False)
    return {"type": "get_info", "model_id": body.model_id, "model_name": record["base_model"],
            "model_data": {"arch": record["base_model"].split("/")[0], "model_name": record["base_model"]},
            **lora_of(record)}  # fmt: skip


@sessions.post("/unload_model")
async def unload_model(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.UnloadModelRequest, await request.body())
    api.known_model(body.model_id)
    return api.queued(api.store.submit("unload_model", b"", body.model_id, dedup=f"unload:{body.model_id}"))


# training requests and their futures -------------------------------------------------------------------------
training = APIRouter()
Numbered = Callable[[Api, Request, bytes], Awaitable[dict[str, Any]]]


def _numbered_route(kind: str) -> Callable[[Numbered], Numbered]:
    """Register a numbered route; its refusals (HTTPError) note the request's number as refused."""

    def register(handler: Numbered) -> Numbered:
        async def route(request: Request, api: Shared) -> dict[str, Any]:
            raw = await request.body()
            try:
                return await handler(api, request, raw)
            except HTTPError as error:
                await api.refused(request.scope, raw, f"refused ({error.status}): {error}")
                raise

        training.add_api_route(f"/{kind}", route, methods=["POST"], name=kind)
        return handler

    return register


@_numbered_route("forward_backward")
async def forward_backward(api: Api, request: Request, body: bytes) -> dict[str, Any]:
    """Checked whole (the worker's budget included) with nothing densified: the worker reads it again, densified."""
    if "protobuf" not in request.headers.get("content-type", ""):
        raise HTTPError(415, "forward_backward takes a Protobuf body (application/x-protobuf)")
    try:
        model_id, seq_id, tokens = wire.check_forward_backward(body, api.worker.requests.budget())
    except wire.WireError as error:
        raise HTTPError(400, str(error)) from None
    api.known_model(model_id)
    if seq_id < 1:
        raise HTTPError(400, f"seq_id must be 1 or more, got {seq_id}")
    if tokens > api.max_request_tokens:
        raise HTTPError(400, f"the request holds {tokens} tokens; a request may hold {api.max_request_tokens} "
                             "(trainer.tinker.max_request_tokens): send fewer data per forward_backward")  # fmt: skip
    return api.queued(api.store.submit("forward_backward", body, model_id, seq=seq_id), model_id)


def _sequenced(kind: str, model: type[BaseModel]) -> None:
    @_numbered_route(kind)
    async def route(api: Api, request: Request, raw: bytes) -> dict[str, Any]:
        body = _parse(model, raw)
        api.known_model(body.model_id)
        if body.seq_id is None or body.seq_id < 1:
            raise HTTPError(400, f"{kind} needs a seq_id of 1 or more")
        return api.queued(api.store.submit(kind, raw, body.model_id, seq=body.seq_id), body.model_id)


_sequenced("optim_step", types.OptimStepRequest)
_sequenced("save_weights", types.SaveWeightsRequest)
_sequenced("save_weights_for_sampler", types.SaveWeightsForSamplerRequest)


@_numbered_route("load_weights")
async def load_weights(api: Api, request: Request, raw: bytes) -> dict[str, Any]:
    body = _parse(types.LoadWeightsRequest, raw)
    try:
        await run_in_threadpool(api.worker.checkpoints.file_of, body.path)
    except wire.WireError as error:
        raise HTTPError(404, str(error)) from None
    if body.session_id is not None:  # a new model made from the checkpoint: its request number 0
        api.session(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        api.store.add_model(model_id, {"base_model": "", "lora": {}, "session": body.session_id,
                                       "created_at": time.time(), "user_metadata": _metadata(body.user_metadata)})  # fmt: skip
        return api.queued(api.store.submit("create_from_state", raw, model_id, seq=0), model_id)
    if body.model_id is None or body.seq_id is None:
        raise HTTPError(400, "load_weights needs session_id and model_seq_id, or model_id and seq_id")
    api.known_model(body.model_id)
    return api.queued(api.store.submit("load_weights", raw, body.model_id, seq=body.seq_id), body.model_id)


@training.post("/retrieve_future")
async def retrieve_future(request: Request, api: Shared) -> Response:
    body = _parse(types.FutureRetrieveRequest, await request.body())
    deadline = time.monotonic() + api.long_poll_s
    event = api.waiters.event(body.request_id)
    try:
        while True:
            result = api.store.result(body.request_id)
            if result is None:
                raise HTTPError(404, f"no request {body.request_id!r} (unknown, or its result expired)")
            if result.status != PENDING:
                api.store.retrieved(body.request_id)
                return Response(result.body, media_type=result.content_type)
            left = deadline - time.monotonic()
            if left <= 0:
                return JSONResponse({"type": "try_again", "request_id": body.request_id,
                                     "queue_state": "active"}, status_code=408)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
    finally:
        api.waiters.events.pop(body.request_id, None)


# sampling ----------------------------------------------------------------------------------------------------
sampling = APIRouter()


@sampling.post("/create_sampling_session")
async def create_sampling_session(request: Request, api: Shared) -> dict[str, Any]:
    body = _parse(types.CreateSamplingSessionRequest, await request.body())
    api.session(body.session_id)
    if body.model_path is not None:
        base_model = (await api.checkpoint_record(body.model_path))["base_model"]
    elif body.base_model in {c.name for c in api.capabilities}:
        base_model = body.base_model
    else:
        raise HTTPError(404, f"unknown base model {body.base_model!r}")
    sampler = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    api.store.add_sampler(sampler, base_model, body.model_path)
    return {"type": "create_sampling_session", "sampling_session_id": sampler}


@sampling.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, api: Shared) -> dict[str, Any]:
    found = api.store.sampler(sampler_id)
    if found is None:
        raise HTTPError(404, f"no sampling session {sampler_id!r}")
    return {"sampler_id": sampler_id, "base_model": found[0], "model_path": found[1]}


@sampling.post("/asample")
async def asample(request: Request, api: Shared) -> dict[str, Any]:
    raw = await request.body()
    body = _parse(types.SampleRequest, raw)
    found = api.store.sampler(body.sampling_session_id) if body.sampling_session_id is not None else None
    if found is None:
        raise HTTPError(404, f"no sampling session {body.sampling_session_id!r}")
    if not 1 <= body.num_samples <= 64:
        raise HTTPError(400, f"num_samples must lie in [1, 64], got {body.num_samples}")
    tokens = body.num_samples * (body.prompt.length + (body.sampling_params.max_tokens or 16))
    if tokens > api.max_request_tokens:
        raise HTTPError(400, f"num_samples x (prompt + max_tokens) is {tokens} tokens; a request may take "
                             f"{api.max_request_tokens} (trainer.tinker.max_request_tokens)")  # fmt: skip
    dedup = f"sample:{body.sampling_session_id}:{body.seq_id}" if body.seq_id is not None else None
    request_id = api.store.submit("sample", raw, dedup=dedup, lane=sampler_lane(*found))
    return api.queued(request_id, sample_sequence_ids=sequence_ids(request_id, body.num_samples))


# training runs and checkpoints (the SDK's RestClient) --------------------------------------------------------
runs = APIRouter()


def _run_record(api: Api, run_id: str) -> dict[str, Any]:
    record = api.store.model(run_id)
    if record is None:
        raise HTTPError(404, f"no training run {run_id!r}")
    return record


def _checkpoint_id(api: Api, run_id: str, kind: str, name: str) -> str:
    """The id of a checkpoint of the run; 404 when it has none of that kind and name."""
    _run_record(api, run_id)
    found = f"{kind}/{name}"
    if api.store.runs.checkpoint(run_id, found) is None:
        raise HTTPError(404, f"training run {run_id!r} has no checkpoint {found!r}")
    return found


def _checkpoint_json(run_id: str, found: str, info: dict[str, Any]) -> dict[str, Any]:
    kind, _, name = found.partition("/")
    return {"checkpoint_id": found, "checkpoint_type": CHECKPOINT_TYPES[kind], "time": _iso(info["created_at"]),
            "tinker_path": tinker_path(run_id, kind, name), "size_bytes": info.get("size_bytes"),
            "public": info.get("public", False), "user_metadata": info.get("user_metadata"),
            "expires_at": _iso(info["expires_at"]) if info.get("expires_at") is not None else None}  # fmt: skip


def _run_checkpoints(api: Api, run_id: str) -> list[dict[str, Any]]:
    listed = [_checkpoint_json(run_id, cid, info) for cid, info in api.store.runs.checkpoints(run_id).items()]
    return sorted(listed, key=lambda c: c["time"])


def _training_run(api: Api, run_id: str) -> dict[str, Any]:
    record, checkpoints = _run_record(api, run_id), _run_checkpoints(api, run_id)
    latest = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
              for kind in ("training", "sampler")}  # fmt: skip
    return {"training_run_id": run_id, "base_model": record["base_model"], "model_owner": OWNER,
            **lora_of(record), "last_request_time": _iso(api.store.runs.last_request_at(run_id)),
            "last_checkpoint": latest["training"], "last_sampler_checkpoint": latest["sampler"],
            "user_metadata": record.get("user_metadata") or None}  # fmt: skip


def _page(request: Request) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", 20))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise HTTPError(400, "limit and offset must be whole numbers") from None
    if not 1 <= limit <= 1000 or offset < 0:
        raise HTTPError(400, f"need 1 <= limit <= 1000 and offset >= 0, got {limit} and {offset}")
    return limit, offset


@runs.get("/training_runs")
async def list_training_runs(request: Request, api: Shared) -> dict[str, Any]:
    limit, offset = _page(request)
    ids = api.store.runs.ids()
    return {"training_runs": [_training_run(api, r) for r in ids[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}  # fmt: skip


@runs.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, api: Shared) -> dict[str, Any]:
    return _training_run(api, run_id)


@runs.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, api: Shared) -> dict[str, Any]:
    _run_record(api, run_id)
    return {"checkpoints": _run_checkpoints(api, run_id)}


@runs.get("/checkpoints")
async def list_user_checkpoints(request: Request, api: Shared) -> dict[str, Any]:
    limit, offset = _page(request)
    every = sorted(
        (c for run in api.store.runs.ids() for c in _run_checkpoints(api, run)),
        key=lambda c: c["time"],
        reverse=True,
    )
    return {"checkpoints": every[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(every)}}  # fmt: skip


@runs.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
def delete_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:  # a def: it deletes files
    api.worker.checkpoints.delete(run_id, _checkpoint_id(api, run_id, kind, name))


def _set_public(api: Api, run_id: str, kind: str, name: str, public: bool) -> None:
    """Mark a checkpoint public or private (a flag the listings show: every client with a key of this server
    reads every checkpoint already); 409 when it already is, as the SDK documents."""
    found = _checkpoint_id(api, run_id, kind, name)
    if bool((api.store.runs.checkpoint(run_id, found) or {}).get("public")) == public:
        raise HTTPError(409, f"checkpoint {found!r} is already {'public' if public else 'private'}")
    api.store.runs.update_checkpoint(run_id, found, public=public)


@runs.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def publish_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:
    _set_public(api, run_id, kind, name, True)


@runs.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def unpublish_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:
    _set_public(api, run_id, kind, name, False)


@runs.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request, api: Shared) -> None:
    found = _checkpoint_id(api, run_id, kind, name)
    try:
        ttl = json.loads(await request.body() or b"{}").get("ttl_seconds")
    except (ValueError, AttributeError):
        raise HTTPError(400, 'the body must be {"ttl_seconds": <seconds> | null}') from None
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise HTTPError(400, f"ttl_seconds must be a whole number of seconds >= 1, or null; got {ttl!r}")
    api.store.runs.update_checkpoint(run_id, found, expires_at=None if ttl is None else time.time() + ttl)


@runs.post("/weights_info")
async def weights_info(request: Request, api: Shared) -> dict[str, Any]:
    try:
        path = json.loads(await request.body()).get("tinker_path")
    except (ValueError, AttributeError):
        raise HTTPError(400, 'the body must be {"tinker_path": "tinker://..."}') from None
    record = await api.checkpoint_record(str(path))
    lora, adapters = record.get("lora") or {}, lora_of(record)
    parts = {f"train_{part}": bool(lora.get(f"train_{part}", True)) if adapters["is_lora"] else None
             for part in ("unembed", "mlp", "attn")}  # fmt: skip
    return {"base_model": record["base_model"], **adapters, **parts}


def _metadata(user_metadata: dict[str, Any] | None) -> dict[str, str]:
    """A run's ``user_metadata`` as the SDK's TrainingRun carries it: strings."""
    return {str(key): str(value) for key, value in (user_metadata or {}).items()}


def _iso(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, UTC).isoformat()


def lora_of(record: dict[str, Any]) -> dict[str, Any]:
    """``is_lora`` and ``lora_rank`` of a model's record: a language model of rank > 0 (a control policy trains
    fully, whatever rank it was asked for)."""
    rank = int((record.get("lora") or {}).get("rank", 0))
    is_lora = record["base_model"] in LANGUAGE_MODELS and rank > 0
    return {"is_lora": is_lora, "lora_rank": rank if is_lora else None}


def build_app(store: Store, worker: Worker, api_keys: list[str], capabilities: list[registry.Capability],
              long_poll_s: float = 20.0, max_request_bytes: int = 64 << 20,
              max_request_tokens: int = 65_536) -> FastAPI:  # fmt: skip
    """The API; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(title="tinker-atropos Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    api = Api(store, worker, capabilities, long_poll_s, max_request_bytes, max_request_tokens)
    app.state.api = api
    worker.on_done = api.waiters.done
    app.add_middleware(
        BodyLimit, limit=max_request_bytes, setting="trainer.tinker.max_request_mb", refused=api.refused
    )
    if api_keys:  # outermost: keys checked first
        app.add_middleware(APIKeys, keys=[key.encode() for key in api_keys], refused=api.refused)
    app.add_exception_handler(HTTPError, _http_error)
    for router in (service, sessions, training, sampling, runs):
        app.include_router(router, prefix="/api/v1")
    return app


async def _http_error(request: Request, error: HTTPError) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status_code=error.status)
