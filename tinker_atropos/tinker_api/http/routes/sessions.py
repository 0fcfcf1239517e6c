"""Sessions and models: created, heart-beaten, finished; a model's creation and its info."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from tinker import types

from tinker_atropos.tinker_api.http.routes.shared import (
    Api,
    HTTPError,
    Shared,
    add_model,
    lora_of,
    metadata_strings,
)

sessions = APIRouter()


@sessions.post("/create_session")
async def create_session(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.CreateSessionRequest, await request.body())
    session_id = await api.redis(
        api.store.sessions.create,
        {"sdk_version": body.sdk_version, "tags": body.tags, "user_metadata": body.user_metadata},
    )
    return {"type": "create_session", "session_id": session_id}


@sessions.post("/session_heartbeat")
async def heartbeat(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.SessionHeartbeatRequest, await request.body())
    if not await api.redis(api.store.sessions.heartbeat, body.session_id):
        raise HTTPError(410, f"session {body.session_id!r} is unknown or finished")
    return {"type": "session_heartbeat"}


@sessions.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, api: Shared) -> None:
    if await api.redis(api.store.sessions.state, session_id) is None:
        raise HTTPError(404, f"no session {session_id!r}")
    expected = '{"reason": {"type": "success" | "errored" | ...}}'
    reason = (await api.json(await request.body(), expected)).get("reason") or {"type": "finished"}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if not isinstance(kind, str):
        raise HTTPError(400, f"the body must be {expected}")
    await api.redis(_finish, api, session_id, kind)


def _finish(api: Api, session_id: str, kind: str) -> None:
    """The session marked finished and its models' unloading queued."""
    api.store.sessions.finish(session_id, kind)
    for model_id in api.store.models.of_session(session_id):
        api.store.requests.submit("unload_model", b"", model_id=model_id)


@sessions.post("/create_model")
async def create_model(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.CreateModelRequest, await request.body())
    await api.session(body.session_id)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    lora = body.lora_config.model_dump() if body.lora_config else {}
    record = {
        "base_model": api.served(body.base_model),
        "lora": lora,
        "session": body.session_id,
        "created_at": time.time(),
        "user_metadata": metadata_strings(body.user_metadata),
    }
    return api.queued(await api.redis(add_model, api.store, model_id, record, "create_model", b""), model_id)


@sessions.post("/get_info")
async def get_info(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.GetInfoRequest, await request.body())
    record = await api.known_model(body.model_id, loaded=False)
    return {
        "type": "get_info",
        "model_id": body.model_id,
        "model_name": record["base_model"],
        "model_data": {"arch": record["base_model"].split("/")[0], "model_name": record["base_model"]},
        **lora_of(record),
    }


@sessions.post("/unload_model")
async def unload_model(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.UnloadModelRequest, await request.body())
    await api.known_model(body.model_id)
    request_id = await api.redis(
        api.store.requests.submit, "unload_model", b"", body.model_id, dedup=f"unload:{body.model_id}"
    )
    return api.queued(request_id)
