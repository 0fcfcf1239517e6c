"""The Tinker HTTP API: what the official SDK calls, answered from the store, with the work queued there for the
worker (``tinker_api/engine/``), which the API never touches. Every route needs an allowed API key in ``X-API-Key`` (unless the run is ``--insecure``); a request the SDK
would not send gets a status and a message, and the server goes on serving everyone else.

One router per resource (``routes/``: sessions and models; training requests and their futures; sampling; the
training runs and checkpoints of the SDK's ``RestClient``; the service itself), each route reaching the store through
the ``Api`` dependency (``routes/shared.py``). A route that reads a file does so in the thread pool, never on the
event loop.

A numbered request (``forward_backward``, ``optim_step``, ``save_weights[_for_sampler]``, ``load_weights``) of a
client that proved its key, refused here by its body or its size, is noted as refused with its number
(``Requests.refuse``): the SDK has used that number, so once its next one arrives the worker answers the refused one
as failed and the model goes on. A request without an allowed key changes nothing: it is answered 401 unread,
counted (``Api.unauthenticated``, in the trainer's status) and logged at most every 10 s.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tinker_atropos.config import Config
from tinker_atropos.errors import FatalError
from tinker_atropos.frontends.bodies import BodyLimit
from tinker_atropos.frontends.http import APIKeys
from tinker_atropos.security import insecure, read_keys, write_secret
from tinker_atropos.tinker_api import base_models
from tinker_atropos.tinker_api.http.routes.runs import runs
from tinker_atropos.tinker_api.http.routes.samples import sampling
from tinker_atropos.tinker_api.http.routes.service import service
from tinker_atropos.tinker_api.http.routes.sessions import sessions
from tinker_atropos.tinker_api.http.routes.shared import Api, HTTPError
from tinker_atropos.tinker_api.http.routes.training import training
from tinker_atropos.tinker_api.store import Store


def build_app(
    store: Store,
    api_keys: list[str],
    capabilities: list[base_models.Capability],
    long_poll_s: float = 20.0,
    max_request_bytes: int = 64 << 20,
    max_request_tokens: int = 65_536,
    max_queued_requests: int = 256,
) -> FastAPI:
    """The API; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(title="tinker-atropos Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    api = Api(store, capabilities, long_poll_s, max_request_bytes, max_request_tokens, max_queued_requests)
    app.state.api = api
    store.requests.finished.append(api.waiters.done)
    app.add_middleware(
        BodyLimit, limit=max_request_bytes, setting="trainer.tinker.max_request_mb", refused=api.refused
    )
    if api_keys:  # outermost: keys checked first
        app.add_middleware(APIKeys, keys=[key.encode() for key in api_keys], refusals=api.unauthenticated)
    app.add_exception_handler(HTTPError, _http_error)
    for router in (service, sessions, training, sampling, runs):
        app.include_router(router, prefix="/api/v1")
    return app


async def _http_error(request: Request, error: HTTPError) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status_code=error.status)


def api_keys(config: Config, run_dir: Path) -> tuple[list[str], Path | None]:
    """The allowed keys and the file they come from; without ``api_keys_file``, a fresh key written (0600) to
    the run folder on first use; none under ``--insecure`` without a file. FatalError for a file that is missing
    or holds a key the SDK would refuse."""
    configured = config.trainer.tinker.api_keys_file
    if configured is None and insecure():
        return [], None
    path = Path(configured) if configured else run_dir / "tinker_api_keys"
    if configured is None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_secret(path, f"tml-{secrets.token_urlsafe(32)}\n")
    keys = read_keys(path, "trainer.tinker.api_keys_file")
    for number, key in enumerate(keys, 1):
        if not key.startswith("tml-") or len(key) < 20:
            raise FatalError(
                f"{path}: key {number} must start with 'tml-' and be at least 20 characters long "
                "(the tinker SDK refuses other keys)"
            )
    return keys, path
