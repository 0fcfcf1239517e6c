"""Training requests (numbered per model, applied in order by the worker) and their futures' long polls."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.http.routes.shared import (
    Api,
    HTTPError,
    Shared,
    add_model,
    metadata_strings,
)
from tinker_atropos.tinker_api.store.files import named
from tinker_atropos.tinker_api.store.queue import PENDING

training = APIRouter()
Numbered = Callable[[Api, Request, bytes], Awaitable[dict[str, Any]]]


def _numbered_route(kind: str) -> Callable[[Numbered], Numbered]:
    """Register a numbered route; its refusals (HTTPError) note the request's number as refused, but for a 429:
    that request comes again, with its number."""

    def register(handler: Numbered) -> Numbered:
        async def route(request: Request, api: Shared) -> dict[str, Any]:
            raw = await request.body()
            try:
                return await handler(api, request, raw)
            except HTTPError as error:
                if error.status != 429:
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
        model_id, seq_id, tokens = await api.off_loop(body, wire.check_forward_backward, body, api.budget())
    except wire.WireError as error:
        raise HTTPError(400, str(error)) from None
    await api.known_model(model_id)
    if seq_id < 1:
        raise HTTPError(400, f"seq_id must be 1 or more, got {seq_id}")
    if tokens > api.max_request_tokens:
        raise HTTPError(
            400,
            f"the request holds {tokens} tokens; a request may hold {api.max_request_tokens} "
            "(trainer.tinker.max_request_tokens): send fewer data per forward_backward",
        )
    await api.within_queue(model_id, seq_id)
    request_id = await api.redis(api.store.requests.submit, "forward_backward", body, model_id, seq=seq_id)
    return api.queued(request_id, model_id)


def _sequenced(kind: str, model: type[BaseModel]) -> None:
    @_numbered_route(kind)
    async def route(api: Api, request: Request, raw: bytes) -> dict[str, Any]:
        body = await api.parse(model, raw)
        await api.known_model(body.model_id)
        if body.seq_id is None or body.seq_id < 1:
            raise HTTPError(400, f"{kind} needs a seq_id of 1 or more")
        if "path" in model.model_fields:  # a save: the checkpoint's name, one segment of a path on disk
            try:
                named(body.model_dump())
            except wire.WireError as error:
                raise HTTPError(400, str(error)) from None
        await api.within_queue(body.model_id, body.seq_id)
        request_id = await api.redis(api.store.requests.submit, kind, raw, body.model_id, seq=body.seq_id)
        return api.queued(request_id, body.model_id)


_sequenced("optim_step", types.OptimStepRequest)
_sequenced("save_weights", types.SaveWeightsRequest)
_sequenced("save_weights_for_sampler", types.SaveWeightsForSamplerRequest)
_sequenced("save_weights_external", types.SaveWeightsExternalRequest)


@_numbered_route("load_weights")
async def load_weights(api: Api, request: Request, raw: bytes) -> dict[str, Any]:
    body = await api.parse(types.LoadWeightsRequest, raw)
    try:
        await run_in_threadpool(api.store.files.file_of, body.path)
    except wire.WireError as error:
        raise HTTPError(404, str(error)) from None
    if body.session_id is not None:  # a new model made from the checkpoint: its request number 0
        await api.session(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        record = {
            "base_model": "",
            "lora": {},
            "session": body.session_id,
            "created_at": time.time(),
            "user_metadata": metadata_strings(body.user_metadata),
        }
        return api.queued(
            await api.redis(add_model, api.store, model_id, record, "create_from_state", raw), model_id
        )
    if body.model_id is None or body.seq_id is None:
        raise HTTPError(400, "load_weights needs session_id and model_seq_id, or model_id and seq_id")
    await api.known_model(body.model_id)
    await api.within_queue(body.model_id, body.seq_id)
    request_id = await api.redis(
        api.store.requests.submit, "load_weights", raw, body.model_id, seq=body.seq_id
    )
    return api.queued(request_id, body.model_id)


@training.post("/retrieve_future")
async def retrieve_future(request: Request, api: Shared) -> Response:
    body = await api.parse(types.FutureRetrieveRequest, await request.body())
    deadline = time.monotonic() + api.long_poll_s
    event = api.waiters.event(body.request_id)
    try:
        while True:
            result = await api.redis(api.store.requests.result, body.request_id)
            if result is None:
                raise HTTPError(404, f"no request {body.request_id!r} (unknown, or its result expired)")
            if result.status != PENDING:
                await api.redis(api.store.requests.retrieved, body.request_id)
                return Response(result.body, media_type=result.content_type)
            left = deadline - time.monotonic()
            if left <= 0:
                return JSONResponse(
                    {"type": "try_again", "request_id": body.request_id, "queue_state": "active"},
                    status_code=408,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
    finally:
        api.waiters.events.pop(body.request_id, None)
