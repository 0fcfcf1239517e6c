"""The Atropos trajectory API over HTTP: atroposlib 0.4.0's routes, request and answer bodies (its environments
and trainers call them unmodified), answered from ``TrajectoryStore``.

Where it differs, it is on purpose: a full queue answers 503 with ``Retry-After`` (an atroposlib environment
retries a 5xx, then drops the group with a log line: never a crash); a group a trainer could not learn from (fields
that do not line up, a NaN score, a token id below 0, a sequence past the registered ``max_token_len``) is a 422,
counted, where the reference queues it and the trainer fails on its batch; ``/status-env`` for an env never
registered is a 404 with a message instead of a 500; Redis away is a 503 and the state is read back from Redis
when it returns; an API key on every route but ``/`` and ``/healthz``. Handlers run one at a time on the event loop
(the store is not shared with any thread), which makes each request's change atomic in the mirror as in Redis.

Two routers: the trainer's side (register, batches, status) and the environments' (register, post scored data),
each route reaching the store as a dependency.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from tinker_atropos.frontends.atropos.store import QueueFull, TrajectoryStore
from tinker_atropos.frontends.http import APIKeys, BodyLimit, GzipRequests

log = logging.getLogger(__name__)


class Registration(BaseModel):
    """A trainer's ``/register``."""

    wandb_group: str
    wandb_project: str
    batch_size: int
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    """An environment's ``/register-env``; ``min_batch_allocation`` is the share of each batch it is owed."""

    max_token_length: int
    desired_name: str
    weight: float
    group_size: int
    min_batch_allocation: float | None = None


MAX_TOKEN_ID = 2**31  # token ids travel as int32 to a Tinker trainer


class _Refused(Exception):
    """A scored group the trainer could not learn from: 422 with the message."""


def _posted_groups(body: Any) -> int:
    """How many groups a refused scored-data post held (a list's length, else one)."""
    return len(body) if isinstance(body, list) and body else 1


class EnvIdentifier(BaseModel):
    env_id: int


class ScoredData(BaseModel):
    """One scored group: a sequence per member (tokens, masks, score), and what a trainer may use besides."""

    model_config = ConfigDict(
        extra="ignore", allow_inf_nan=False
    )  # a NaN score would reach the trainer's loss

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None  # [sequence][position][top k]
    distill_logprobs: list[list[list[float]]] | None = None

    @model_validator(mode="after")
    def _lined_up(self) -> ScoredData:
        """A group whose fields do not line up is refused here (422), not found out by a trainer, which would
        lose the whole batch it landed in; the reference accepts it."""
        if not len(self.tokens) == len(self.masks) == len(self.scores) or not self.tokens:
            raise ValueError(f"tokens, masks and scores need one entry per sequence, at least one: got "
                             f"{len(self.tokens)}, {len(self.masks)} and {len(self.scores)}")  # fmt: skip
        for i, row in enumerate(self.tokens):
            if row and not 0 <= min(row) <= max(row) < MAX_TOKEN_ID:
                raise ValueError(f"tokens[{i}] holds an id outside [0, {MAX_TOKEN_ID})")
        for name in ("masks", "inference_logprobs", "advantages"):
            for i, row in enumerate(getattr(self, name) or []):
                if row is not None and len(row) != len(self.tokens[i]):
                    raise ValueError(f"{name}[{i}] has {len(row)} entries for {len(self.tokens[i])} tokens")
        return self

    @field_validator("messages")
    @classmethod
    def _roles_and_contents(cls, messages: list[list[dict[str, Any]]] | None) -> Any:
        for conversation in messages or []:
            for message in conversation:
                if "role" not in message or "content" not in message:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return messages


SCORED_ROUTES = ("/scored_data", "/scored_data_list")


async def _store(request: Request) -> TrajectoryStore:  # async: a plain def would run in the thread pool
    return request.app.state.store


Store = Annotated[TrajectoryStore, Depends(_store)]


# the trainer's side -----------------------------------------------------------------------------------------
trainers = APIRouter()


@trainers.get("/")
async def root() -> dict[str, str]:
    return {"message": "AtroposLib API"}


@trainers.get("/healthz")
async def healthz(store: Store) -> dict[str, Any]:
    return {"status": "ok", **store.figures()}


@trainers.post("/register")
async def register(registration: Registration, store: Store) -> dict[str, Any]:
    return store.register(registration.model_dump())


@trainers.get("/wandb_info")
async def wandb_info(store: Store) -> dict[str, Any]:
    return store.wandb_info()


@trainers.get("/info")
async def info(store: Store) -> dict[str, Any]:
    return store.info()


@trainers.get("/batch")
async def batch(store: Store) -> dict[str, Any]:
    return store.batch()


@trainers.get("/latest_example")
async def latest_example(store: Store) -> Any:
    return store.latest_example()


@trainers.get("/status")
async def status(store: Store) -> dict[str, Any]:
    return store.status()


@trainers.get("/reset_data")
async def reset_data(store: Store) -> PlainTextResponse:
    store.reset()
    return PlainTextResponse("Reset successful")


# the environments' side -------------------------------------------------------------------------------------
envs = APIRouter()


@envs.post("/register-env")
async def register_env(fields: RegisterEnv, store: Store) -> dict[str, Any]:
    return store.register_env(fields.model_dump())


@envs.post("/disconnect-env")
async def disconnect_env(env: EnvIdentifier, store: Store) -> dict[str, Any]:
    return store.disconnect_env(env.env_id)


def _within_token_length(store: TrajectoryStore, groups: list[ScoredData]) -> None:
    """422 (counted) for a sequence past the ``max_token_len`` the trainer registered: it could not learn it."""
    limit = store.info()["max_token_len"]
    for g, group in enumerate(groups):
        for i, tokens in enumerate(group.tokens):
            if 0 < limit < len(tokens):
                store.refuse_invalid(len(groups))
                where = f"[{g}]" if len(groups) > 1 else ""
                raise _Refused(f"body{where}.tokens[{i}] has {len(tokens)} tokens; the trainer registered "
                               f"max_token_len {limit}")  # fmt: skip


@envs.post("/scored_data")
async def scored_data(group: ScoredData, store: Store) -> dict[str, Any]:
    _within_token_length(store, [group])
    return store.post([group.model_dump()])[0]


@envs.post("/scored_data_list")
async def scored_data_list(groups: list[ScoredData], store: Store) -> dict[str, Any]:
    _within_token_length(store, groups)
    answers = store.post([g.model_dump() for g in groups])
    buffered = [a for a in answers if a["status"] == "buffered"]
    answer: dict[str, Any] = {"status": "received", "groups_processed": len(groups)}
    if buffered:
        answer |= {"buffered": len(buffered), "last_buffer_size": buffered[-1]["buffer_size"]}
    return answer


@envs.get("/status-env")
async def status_env(
    env: EnvIdentifier, store: Store
) -> Any:  # a GET with a JSON body, as atroposlib sends it
    answer = store.status_env(env.env_id)
    if answer is None:
        return JSONResponse({"detail": f"env_id {env.env_id} is not registered (POST /register-env)"},
                            status_code=404)  # fmt: skip
    return answer


# errors -----------------------------------------------------------------------------------------------------
def _retry_later(request: Request, detail: str) -> JSONResponse:
    """503 with the ``Retry-After`` this API was built with."""
    return JSONResponse({"detail": detail}, status_code=503,
                        headers={"Retry-After": str(request.app.state.retry_after_s)})  # fmt: skip


async def _redis_away(request: Request, error: redis.RedisError) -> JSONResponse:
    request.app.state.store.stale = (
        True  # a write may have failed half-way in the mirror: read Redis back first
    )
    log.warning("Redis unavailable during %s: %s", request.url.path, error)
    return _retry_later(request, f"the state store (Redis) is unavailable: {error}")


async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
    """422 as FastAPI answers it (without the values given: a NaN is no JSON), the refused groups of a scored-data
    post counted."""
    if request.url.path in SCORED_ROUTES:
        request.app.state.store.refuse_invalid(_posted_groups(error.body))
    detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in error.errors()]
    return JSONResponse({"detail": detail}, status_code=422)


async def _refused(request: Request, error: _Refused) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, status_code=422)


async def _queue_full(request: Request, error: QueueFull) -> JSONResponse:
    return _retry_later(request, str(error))


def build_app(
    store: TrajectoryStore, api_keys: list[str], max_request_bytes: int, retry_after_s: int = 1
) -> FastAPI:
    """The API; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(
        title="tinker-atropos Atropos trajectory API", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.store, app.state.retry_after_s = store, retry_after_s
    app.add_middleware(GZipMiddleware, minimum_size=1000)  # batches are large: gzip answers to who accepts it
    app.add_middleware(GzipRequests, limit=max_request_bytes, setting="atropos.max_request_mb")
    app.add_middleware(BodyLimit, limit=max_request_bytes, setting="atropos.max_request_mb")
    if api_keys:
        app.add_middleware(
            APIKeys, keys=[k.encode() for k in api_keys], open_paths=frozenset({"/", "/healthz"})
        )
    for error, handler in ((redis.RedisError, _redis_away), (RequestValidationError, _invalid),
                           (_Refused, _refused), (QueueFull, _queue_full)):  # fmt: skip
        app.add_exception_handler(error, handler)
    app.include_router(trainers)
    app.include_router(envs)
    return app
