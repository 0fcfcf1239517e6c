"""The training runs and checkpoints of the SDK's ``RestClient``: listed, looked up by tinker path, deleted,
published, their TTL set. Each route's reads and writes of the store are one function, run by ``Api.redis``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from tinker_atropos.tinker_api.http.routes.shared import (
    CHECKPOINT_TYPES,
    OWNER,
    Api,
    HTTPError,
    Shared,
    iso,
    lora_of,
)
from tinker_atropos.tinker_api.store.files import tinker_path

runs = APIRouter()


def _run_record(api: Api, run_id: str) -> dict[str, Any]:
    record = api.store.models.record(run_id)
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
    return {
        "checkpoint_id": found,
        "checkpoint_type": CHECKPOINT_TYPES[kind],
        "time": iso(info["created_at"]),
        "tinker_path": tinker_path(run_id, kind, name),
        "size_bytes": info.get("size_bytes"),
        "public": info.get("public", False),
        "user_metadata": info.get("user_metadata"),
        "expires_at": iso(info["expires_at"]) if info.get("expires_at") is not None else None,
    }


def _run_checkpoints(api: Api, run_id: str) -> list[dict[str, Any]]:
    listed = [_checkpoint_json(run_id, cid, info) for cid, info in api.store.runs.checkpoints(run_id).items()]
    return sorted(listed, key=lambda c: c["time"])


def _training_run(api: Api, run_id: str) -> dict[str, Any]:
    record, checkpoints = _run_record(api, run_id), _run_checkpoints(api, run_id)
    latest = {
        kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
        for kind in ("training", "sampler")
    }
    return {
        "training_run_id": run_id,
        "base_model": record["base_model"],
        "model_owner": OWNER,
        **lora_of(record),
        "last_request_time": iso(api.store.runs.last_request_at(run_id)),
        "last_checkpoint": latest["training"],
        "last_sampler_checkpoint": latest["sampler"],
        "user_metadata": record.get("user_metadata") or None,
    }


def _page(request: Request) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", 20))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise HTTPError(400, "limit and offset must be whole numbers") from None
    if not 1 <= limit <= 1000 or offset < 0:
        raise HTTPError(400, f"need 1 <= limit <= 1000 and offset >= 0, got {limit} and {offset}")
    return limit, offset


def _training_runs(api: Api, limit: int, offset: int) -> dict[str, Any]:
    ids = api.store.runs.ids()
    return {
        "training_runs": [_training_run(api, r) for r in ids[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
    }


def _checkpoints(api: Api, run_id: str) -> dict[str, Any]:
    _run_record(api, run_id)
    return {"checkpoints": _run_checkpoints(api, run_id)}


def _user_checkpoints(api: Api, limit: int, offset: int) -> dict[str, Any]:
    every = sorted(
        (c for run in api.store.runs.ids() for c in _run_checkpoints(api, run)),
        key=lambda c: c["time"],
        reverse=True,
    )
    return {
        "checkpoints": every[offset : offset + limit],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
    }


def _delete(api: Api, run_id: str, kind: str, name: str) -> None:
    api.store.files.delete(run_id, _checkpoint_id(api, run_id, kind, name))


@runs.get("/training_runs")
async def list_training_runs(request: Request, api: Shared) -> dict[str, Any]:
    return await api.redis(_training_runs, api, *_page(request))


@runs.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, api: Shared) -> dict[str, Any]:
    return await api.redis(_training_run, api, run_id)


@runs.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, api: Shared) -> dict[str, Any]:
    return await api.redis(_checkpoints, api, run_id)


@runs.get("/checkpoints")
async def list_user_checkpoints(request: Request, api: Shared) -> dict[str, Any]:
    return await api.redis(_user_checkpoints, api, *_page(request))


@runs.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:
    await api.redis(_delete, api, run_id, kind, name)  # its files too: off the event loop as well


def _set_public(api: Api, run_id: str, kind: str, name: str, public: bool) -> None:
    """Mark a checkpoint public or private (a flag the listings show: every client with a key of this server
    reads every checkpoint already); 409 when it already is, as the SDK documents."""
    found = _checkpoint_id(api, run_id, kind, name)
    if bool((api.store.runs.checkpoint(run_id, found) or {}).get("public")) == public:
        raise HTTPError(409, f"checkpoint {found!r} is already {'public' if public else 'private'}")
    api.store.runs.update_checkpoint(run_id, found, public=public)


@runs.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def publish_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:
    await api.redis(_set_public, api, run_id, kind, name, True)


@runs.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def unpublish_checkpoint(run_id: str, kind: str, name: str, api: Shared) -> None:
    await api.redis(_set_public, api, run_id, kind, name, False)


@runs.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request, api: Shared) -> None:
    found = await api.redis(_checkpoint_id, api, run_id, kind, name)
    ttl = (await api.json(await request.body(), '{"ttl_seconds": <seconds> | null}')).get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise HTTPError(400, f"ttl_seconds must be a whole number of seconds >= 1, or null; got {ttl!r}")
    expires_at = None if ttl is None else time.time() + ttl
    await api.redis(api.store.runs.update_checkpoint, run_id, found, expires_at=expires_at)


@runs.post("/weights_info")
async def weights_info(request: Request, api: Shared) -> dict[str, Any]:
    path = (await api.json(await request.body(), '{"tinker_path": "tinker://..."}')).get("tinker_path")
    record = await api.checkpoint_record(str(path))
    lora, adapters = record.get("lora") or {}, lora_of(record)
    parts = {
        f"train_{part}": bool(lora.get(f"train_{part}", True)) if adapters["is_lora"] else None
        for part in ("unembed", "mlp", "attn")
    }
    return {"base_model": record["base_model"], **adapters, **parts}
