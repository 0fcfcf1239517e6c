"""The Tinker HTTP API: what the official SDK calls, answered from the store, with the work queued for the
worker. Every route needs an allowed API key in ``X-API-Key`` (unless the run is ``--insecure``); a request the SDK
would not send gets a status and a message, and the server goes on serving everyone else.

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
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Scope
from tinker import types

from tinker_atropos.frontends.http import APIKeys, BodyLimit
from tinker_atropos.frontends.tinker import registry, wire
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


def build_app(store: Store, worker: Worker, api_keys: list[str], capabilities: list[registry.Capability],
              long_poll_s: float = 20.0, max_request_bytes: int = 64 << 20,
              max_request_tokens: int = 65_536) -> FastAPI:  # fmt: skip
    """The API; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(title="tinker-atropos Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    waiters = Waiters()
    worker.on_done = waiters.done

    async def refused(scope: Scope, body: bytes, reason: str) -> None:
        """A numbered request refused before it was queued: its number noted, to be answered as failed."""
        found = numbered(scope["path"].removeprefix("/api/v1/"), body)
        if found is not None and store.refuse(*found, reason):
            worker.wake.set()

    app.add_middleware(
        BodyLimit, limit=max_request_bytes, setting="trainer.tinker.max_request_mb", refused=refused
    )
    if api_keys:  # outermost: keys checked first
        app.add_middleware(APIKeys, keys=[key.encode() for key in api_keys], refused=refused)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, error: HTTPError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=error.status)

    def queued(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        worker.wake.set()
        return {"request_id": request_id, "model_id": model_id, **extra}

    def known_model(model_id: str, loaded: bool = True) -> dict[str, Any]:
        """The model's record; 404 for no such model, or (``loaded``) one unloaded since (its session ended)."""
        record, is_loaded = store.model_if_loaded(model_id)
        if record is None:
            raise HTTPError(404, f"no model {model_id!r}")
        if loaded and not is_loaded:
            raise HTTPError(404, f"model {model_id!r} was unloaded (unload_model, or its session finished)")
        return record

    def session(session_id: str) -> None:
        """404 for no such session, 410 for a finished one (as the SDK's heartbeat expects)."""
        state = store.session_state(session_id)
        if state is None:
            raise HTTPError(404, f"no session {session_id!r}")
        if state:
            raise HTTPError(410, f"session {session_id!r} is finished ({state})")

    # start-up and sessions -------------------------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "use_pyqwest_transport": False,
            # the SDK splits a forward_backward's data into requests of at most this many (estimated) bytes:
            # below the body limit, with room for what its estimate leaves out
            "fwdbwd_max_chunk_bytes_count": max_request_bytes * 3 // 4,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def server_capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": c.name, "trainable": c.trainable, "sampleable": c.sampleable,
                                      "max_context_length": c.max_context_length} for c in capabilities]}  # fmt: skip

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = _parse(types.CreateSessionRequest, await request.body())
        session_id = store.create_session({"sdk_version": body.sdk_version, "tags": body.tags,
                                           "user_metadata": body.user_metadata})  # fmt: skip
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        body = _parse(types.SessionHeartbeatRequest, await request.body())
        if not store.heartbeat(body.session_id):
            raise HTTPError(410, f"session {body.session_id!r} is unknown or finished")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's own telemetry: nothing here consumes it

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> None:
        if store.session_state(session_id) is None:
            raise HTTPError(404, f"no session {session_id!r}")
        try:
            body = json.loads(await request.body() or b"{}")
            reason = body.get("reason") or {"type": "finished"}
            kind = reason["type"]
            if not isinstance(kind, str):
                raise TypeError(kind)
        except (ValueError, AttributeError, KeyError, TypeError):
            raise HTTPError(
                400, 'the body must be {"reason": {"type": "success" | "errored" | ...}}'
            ) from None
        for model_id in store.finish_session(session_id, kind):
            store.submit("unload_model", b"", model_id=model_id)
        worker.wake.set()

    # training ---------------------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = _parse(types.CreateModelRequest, await request.body())
        session(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        lora = body.lora_config.model_dump() if body.lora_config else {}
        record = {
            "base_model": body.base_model,
            "lora": lora,
            "session": body.session_id,
            "created_at": time.time(),
            "user_metadata": _metadata(body.user_metadata),
        }
        store.add_model(model_id, record)
        return queued(store.submit("create_model", b"", model_id, seq=0), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        body = _parse(types.GetInfoRequest, await request.body())
        record = known_model(body.model_id, loaded=False)
        return {"type": "get_info", "model_id": body.model_id, "model_name": record["base_model"],
                "model_data": {"arch": record["base_model"].split("/")[0], "model_name": record["base_model"]},
                **lora_of(record)}  # fmt: skip

    def numbered_route(kind: str) -> Callable[[Callable[[Request, bytes], Awaitable[dict[str, Any]]]], None]:
        """Register a numbered route; its refusals (HTTPError) note the request's number as refused."""

        def register(handler: Callable[[Request, bytes], Awaitable[dict[str, Any]]]) -> None:
            async def route(request: Request) -> dict[str, Any]:
                raw = await request.body()
                try:
                    return await handler(request, raw)
                except HTTPError as error:
                    await refused(request.scope, raw, f"refused ({error.status}): {error}")
                    raise

            app.post(f"/api/v1/{kind}")(route)

        return register

    @numbered_route("forward_backward")
    async def forward_backward(request: Request, body: bytes) -> dict[str, Any]:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise HTTPError(415, "forward_backward takes a Protobuf body (application/x-protobuf)")
        try:
            parsed = wire.parse_forward_backward(body, worker.budget())
        except wire.WireError as error:
            raise HTTPError(400, str(error)) from None
        known_model(parsed.model_id)
        if parsed.seq_id < 1:
            raise HTTPError(400, f"seq_id must be 1 or more, got {parsed.seq_id}")
        tokens = sum(len(d.tokens) for d in parsed.data)
        if tokens > max_request_tokens:
            raise HTTPError(400, f"the request holds {tokens} tokens; a request may hold {max_request_tokens} "
                                 "(trainer.tinker.max_request_tokens): send fewer data per forward_backward")  # fmt: skip
        return queued(
            store.submit("forward_backward", body, parsed.model_id, seq=parsed.seq_id), parsed.model_id
        )

    def sequenced(kind: str, model: type[BaseModel]) -> None:
        @numbered_route(kind)
        async def route(request: Request, raw: bytes) -> dict[str, Any]:
            body = _parse(model, raw)
            known_model(body.model_id)
            if body.seq_id is None or body.seq_id < 1:
                raise HTTPError(400, f"{kind} needs a seq_id of 1 or more")
            return queued(store.submit(kind, raw, body.model_id, seq=body.seq_id), body.model_id)

    sequenced("optim_step", types.OptimStepRequest)
    sequenced("save_weights", types.SaveWeightsRequest)
    sequenced("save_weights_for_sampler", types.SaveWeightsForSamplerRequest)

    @numbered_route("load_weights")
    async def load_weights(request: Request, raw: bytes) -> dict[str, Any]:
        body = _parse(types.LoadWeightsRequest, raw)
        try:
            worker.file_of(body.path)
        except wire.WireError as error:
            raise HTTPError(404, str(error)) from None
        if body.session_id is not None:  # a new model made from the checkpoint: its request number 0
            session(body.session_id)
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
            store.add_model(model_id, {"base_model": "", "lora": {}, "session": body.session_id,
                                       "created_at": time.time(), "user_metadata": _metadata(body.user_metadata)})  # fmt: skip
            return queued(store.submit("create_from_state", raw, model_id, seq=0), model_id)
        if body.model_id is None or body.seq_id is None:
            raise HTTPError(400, "load_weights needs session_id and model_seq_id, or model_id and seq_id")
        known_model(body.model_id)
        return queued(store.submit("load_weights", raw, body.model_id, seq=body.seq_id), body.model_id)

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        body = _parse(types.UnloadModelRequest, await request.body())
        known_model(body.model_id)
        return queued(store.submit("unload_model", b"", body.model_id, dedup=f"unload:{body.model_id}"))

    # futures ------------------------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = _parse(types.FutureRetrieveRequest, await request.body())
        deadline = time.monotonic() + long_poll_s
        event = waiters.event(body.request_id)
        try:
            while True:
                result = store.result(body.request_id)
                if result is None:
                    raise HTTPError(404, f"no request {body.request_id!r} (unknown, or its result expired)")
                if result.status != PENDING:
                    store.retrieved(body.request_id)
                    return Response(result.body, media_type=result.content_type)
                left = deadline - time.monotonic()
                if left <= 0:
                    return JSONResponse({"type": "try_again", "request_id": body.request_id,
                                         "queue_state": "active"}, status_code=408)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
        finally:
            waiters.events.pop(body.request_id, None)

    # sampling -----------------------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = _parse(types.CreateSamplingSessionRequest, await request.body())
        session(body.session_id)
        if body.model_path is not None:
            try:
                base_model = worker.checkpoint_record(body.model_path)["base_model"]
            except wire.WireError as error:
                raise HTTPError(404, str(error)) from None
        elif body.base_model in {c.name for c in capabilities}:
            base_model = body.base_model
        else:
            raise HTTPError(404, f"unknown base model {body.base_model!r}")
        sampler = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        store.add_sampler(sampler, base_model, body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        found = store.sampler(sampler_id)
        if found is None:
            raise HTTPError(404, f"no sampling session {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": found[0], "model_path": found[1]}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        raw = await request.body()
        body = _parse(types.SampleRequest, raw)
        found = store.sampler(body.sampling_session_id) if body.sampling_session_id is not None else None
        if found is None:
            raise HTTPError(404, f"no sampling session {body.sampling_session_id!r}")
        if not 1 <= body.num_samples <= 64:
            raise HTTPError(400, f"num_samples must lie in [1, 64], got {body.num_samples}")
        tokens = body.num_samples * (body.prompt.length + (body.sampling_params.max_tokens or 16))
        if tokens > max_request_tokens:
            raise HTTPError(400, f"num_samples x (prompt + max_tokens) is {tokens} tokens; a request may take "
                                 f"{max_request_tokens} (trainer.tinker.max_request_tokens)")  # fmt: skip
        dedup = f"sample:{body.sampling_session_id}:{body.seq_id}" if body.seq_id is not None else None
        request_id = store.submit("sample", raw, dedup=dedup, lane=sampler_lane(*found))
        return queued(request_id, sample_sequence_ids=sequence_ids(request_id, body.num_samples))

    # training runs and checkpoints (the SDK's RestClient) ---------------------------------------------------
    def run_record(run_id: str) -> dict[str, Any]:
        record = store.model(run_id)
        if record is None:
            raise HTTPError(404, f"no training run {run_id!r}")
        return record

    def checkpoint_id(run_id: str, kind: str, name: str) -> str:
        """The id of a checkpoint of the run; 404 when it has none of that kind and name."""
        run_record(run_id)
        found = f"{kind}/{name}"
        if store.runs.checkpoint(run_id, found) is None:
            raise HTTPError(404, f"training run {run_id!r} has no checkpoint {found!r}")
        return found

    def checkpoint_json(run_id: str, found: str, info: dict[str, Any]) -> dict[str, Any]:
        kind, _, name = found.partition("/")
        return {"checkpoint_id": found, "checkpoint_type": CHECKPOINT_TYPES[kind], "time": _iso(info["created_at"]),
                "tinker_path": worker.tinker_path(run_id, kind, name), "size_bytes": info.get("size_bytes"),
                "public": info.get("public", False), "user_metadata": info.get("user_metadata"),
                "expires_at": _iso(info["expires_at"]) if info.get("expires_at") is not None else None}  # fmt: skip

    def run_checkpoints(run_id: str) -> list[dict[str, Any]]:
        listed = [checkpoint_json(run_id, cid, info) for cid, info in store.runs.checkpoints(run_id).items()]
        return sorted(listed, key=lambda c: c["time"])

    def training_run(run_id: str) -> dict[str, Any]:
        record, checkpoints = run_record(run_id), run_checkpoints(run_id)
        latest = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
                  for kind in ("training", "sampler")}  # fmt: skip
        return {"training_run_id": run_id, "base_model": record["base_model"], "model_owner": OWNER,
                **lora_of(record), "last_request_time": _iso(store.runs.last_request_at(run_id)),
                "last_checkpoint": latest["training"], "last_sampler_checkpoint": latest["sampler"],
                "user_metadata": record.get("user_metadata") or None}  # fmt: skip

    def page(request: Request) -> tuple[int, int]:
        try:
            limit = int(request.query_params.get("limit", 20))
            offset = int(request.query_params.get("offset", 0))
        except ValueError:
            raise HTTPError(400, "limit and offset must be whole numbers") from None
        if not 1 <= limit <= 1000 or offset < 0:
            raise HTTPError(400, f"need 1 <= limit <= 1000 and offset >= 0, got {limit} and {offset}")
        return limit, offset

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request) -> dict[str, Any]:
        limit, offset = page(request)
        runs = store.runs.ids()
        return {"training_runs": [training_run(r) for r in runs[offset : offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}  # fmt: skip

    @app.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str) -> dict[str, Any]:
        return training_run(run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str) -> dict[str, Any]:
        run_record(run_id)
        return {"checkpoints": run_checkpoints(run_id)}

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict[str, Any]:
        limit, offset = page(request)
        every = sorted(
            (c for run in store.runs.ids() for c in run_checkpoints(run)),
            key=lambda c: c["time"],
            reverse=True,
        )
        return {"checkpoints": every[offset : offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(every)}}  # fmt: skip

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str) -> None:
        worker.delete_checkpoint(run_id, checkpoint_id(run_id, kind, name))

    def set_public(run_id: str, kind: str, name: str, public: bool) -> None:
        """Mark a checkpoint public or private (a flag the listings show: every client with a key of this
        server reads every checkpoint already); 409 when it already is, as the SDK documents."""
        found = checkpoint_id(run_id, kind, name)
        if bool((store.runs.checkpoint(run_id, found) or {}).get("public")) == public:
            raise HTTPError(409, f"checkpoint {found!r} is already {'public' if public else 'private'}")
        store.runs.update_checkpoint(run_id, found, public=public)

    @app.post("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish_checkpoint(run_id: str, kind: str, name: str) -> None:
        set_public(run_id, kind, name, True)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish_checkpoint(run_id: str, kind: str, name: str) -> None:
        set_public(run_id, kind, name, False)

    @app.put("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request) -> None:
        found = checkpoint_id(run_id, kind, name)
        try:
            ttl = json.loads(await request.body() or b"{}").get("ttl_seconds")
        except (ValueError, AttributeError):
            raise HTTPError(400, 'the body must be {"ttl_seconds": <seconds> | null}') from None
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise HTTPError(400, f"ttl_seconds must be a whole number of seconds >= 1, or null; got {ttl!r}")
        store.runs.update_checkpoint(run_id, found, expires_at=None if ttl is None else time.time() + ttl)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        try:
            path = json.loads(await request.body()).get("tinker_path")
        except (ValueError, AttributeError):
            raise HTTPError(400, 'the body must be {"tinker_path": "tinker://..."}') from None
        try:
            record = worker.checkpoint_record(str(path))
        except wire.WireError as error:
            raise HTTPError(404, str(error)) from None
        lora, adapters = record.get("lora") or {}, lora_of(record)
        parts = {f"train_{part}": bool(lora.get(f"train_{part}", True)) if adapters["is_lora"] else None
                 for part in ("unembed", "mlp", "attn")}  # fmt: skip
        return {"base_model": record["base_model"], **adapters, **parts}

    def unserved(reason: str) -> Callable[[Request], Awaitable[None]]:
        async def route(request: Request) -> None:
            await refused(request.scope, await request.body(), f"refused (404): {reason}")
            raise HTTPError(404, f"not served by this trainer: {reason}")

        return route

    for (method, path), reason in UNSERVED.items():
        app.add_api_route(path, unserved(reason), methods=[method])

    return app


OWNER = "tinker-atropos"  # the runs of one server share its API keys: no owner of their own
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}


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
