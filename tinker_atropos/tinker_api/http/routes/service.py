"""The service itself: client configuration, health, capabilities, telemetry, and the SDK's calls this server
refuses (each a 404 that says why)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from tinker_atropos.tinker_api.http.routes.shared import Api, HTTPError, Shared

# the SDK's calls this server refuses, each with a 404 that says why (a 404 because the SDK retries a 501)
UNSERVED = {
    (
        "GET",
        "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
    ): "download URLs "
    "of external weights: save_weights_external writes them to the trainer's disk, in its checkpoint folder "
    "(trainer.tinker.checkpoint_dir, by default <run folder>/tinker/<model>/external_weights/<name>/)",
    ("POST", "/api/v1/copy_weights"): "copy_weights: checkpoints stay in the run folder that saved them",
    ("POST", "/api/v1/join_sampling_session"): "join_sampling_session: create a sampling client instead",
    ("POST", "/api/v1/create_custom_loss"): "server-side custom losses: forward_backward_custom runs on the "
    "client, over cross_entropy",
    ("POST", "/api/v1/cancel_future"): "cancel_future: a queued request runs, and its result expires",
    **{
        (method, f"/api/v1/sessions{path}"): "sessions (listing, search, records, projects, trace export): "
        "they are internal to this trainer"
        for method, path in (
            ("GET", ""),
            ("POST", "/search"),
            ("GET", "/{session_id}"),
            ("PUT", "/{session_id}/project"),
            ("GET", "/{session_id}/trace_export"),
        )
    },
    ("GET", "/api/v1/audit"): "the audit log: this server keeps no accounts",
    ("GET", "/api/v1/billing/usage/events"): "billing: this server keeps no accounts",
    (
        "GET",
        "/api/v1/billing/usage/checkpoints/current",
    ): "checkpoint storage usage, for billing: this server "
    "keeps no accounts (list_checkpoints gives each checkpoint's size)",
}
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
    return {
        "supported_models": [
            {
                "model_name": c.name,
                "trainable": c.trainable,
                "sampleable": c.sampleable,
                "max_context_length": c.max_context_length,
            }
            for c in api.capabilities
        ]
    }


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
