"""The Atropos trajectory API over HTTP: atroposlib 0.4.0's routes, request and answer bodies (its environments
and trainers call them unmodified), answered from ``TrajectoryStore``.

Where it differs, it is on purpose: a full queue answers 503 with ``Retry-After`` (an atroposlib environment
retries a 5xx, then drops the group with a log line: never a crash); a group a trainer could not learn from (fields
that do not line up, a NaN score, a token id below 0, a sequence past the registered ``max_token_len``) is a 422,
counted, where the reference queues it and the trainer fails on its batch; ``/status-env`` for an env never
registered is a 404 with a message instead of a 500; Redis away (or hung: no answer within
``http.REDIS_WAIT_S``) is a 503 and the state is read back from Redis when it returns; an API key on every route but
``/`` and ``/healthz``. A request's work on the store is one call in the store's one thread (``RedisCalls``), never
on the event loop: one at a time, which makes each request's change atomic in the mirror as in Redis, and a Redis
that hangs holds that thread, not ``/healthz`` (the mirror's figures) nor the reading of other requests' bodies.

Two routers: the trainer's side (register, batches, status) and the environments' (register, post scored data),
each route reaching the store as a dependency.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from tinker_atropos.frontends.atropos.rows import CompactRows, GroupReader, encode, row_lengths
from tinker_atropos.frontends.atropos.store import QueueFull, TrajectoryStore
from tinker_atropos.frontends.bodies import (
    BodyError,
    BodyLimit,
    GzipRequests,
    JSONBodies,
    body_error,
    json_body,
)
from tinker_atropos.frontends.http import APIKeys, RedisCalls

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


class EnvIdentifier(BaseModel):
    env_id: int


# lists that stop at their first bad item: a body of a million bad ids makes one error, not a million (``Field``
# rather than ``FailFast()``, which is not hashable and so cannot sit in a union with None)
FAIL_FAST = Field(fail_fast=True)
Ints = Annotated[list[int], FAIL_FAST]
Floats = Annotated[list[float], FAIL_FAST]
Dicts = Annotated[list[dict[str, Any]], FAIL_FAST]
IntRows = Annotated[list[Ints], FAIL_FAST]
FloatRows = Annotated[list[Floats], FAIL_FAST]
DictRows = Annotated[list[Dicts], FAIL_FAST]


def _compact(value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
    """Rows read as CompactRows (``GroupReader``) were checked as they were read: kept as they are."""
    return value if isinstance(value, CompactRows) else validate(value)


# a group's rows of numbers: CompactRows where a large body's were read so, lists otherwise
CompactIntRows = Annotated[IntRows, WrapValidator(_compact)]
CompactFloatRows = Annotated[FloatRows, WrapValidator(_compact)]


class ScoredData(BaseModel):
    """One scored group: a sequence per member (tokens, masks, score), and what a trainer may use besides."""

    # a NaN score would reach the trainer's loss
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    tokens: CompactIntRows
    masks: CompactIntRows
    scores: Floats
    advantages: CompactFloatRows | None = None
    ref_logprobs: CompactFloatRows | None = None
    messages: DictRows | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: CompactFloatRows | None = None
    overrides: Dicts | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: Annotated[list[IntRows], FAIL_FAST] | None = None  # [sequence][position][top k]
    distill_logprobs: Annotated[list[FloatRows], FAIL_FAST] | None = None

    @model_validator(mode="after")
    def _token_ids(self) -> ScoredData:
        if isinstance(self.tokens, CompactRows):
            return self  # its ids were read in range
        for i, row in enumerate(self.tokens):
            if row and not 0 <= min(row) <= max(row) < MAX_TOKEN_ID:
                raise ValueError(f"tokens[{i}] holds an id outside [0, {MAX_TOKEN_ID})")
        return self

    @field_validator("messages")
    @classmethod
    def _roles_and_contents(cls, messages: list[list[dict[str, Any]]] | None) -> Any:
        for conversation in messages or []:
            for message in conversation:
                if "role" not in message or "content" not in message:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return messages


def lined_up(group: Any, where: str = "") -> None:
    """ValueError for a group (parsed JSON, not validated yet) whose fields do not line up, so that it is refused
    (422) before validation builds anything per item, and not found out by a trainer, which would lose the whole
    batch it landed in (the reference accepts it). Fields of the wrong type are left to validation."""
    if not isinstance(group, dict):
        return
    tokens, masks, scores = (group.get(k) for k in ("tokens", "masks", "scores"))
    if not all(isinstance(v, list | CompactRows) for v in (tokens, masks, scores)):
        return
    if not len(tokens) == len(masks) == len(scores) or not tokens:
        raise ValueError(
            f"{where}tokens, masks and scores need one entry per sequence, at least one: got "
            f"{len(tokens)}, {len(masks)} and {len(scores)}"
        )
    sequences = row_lengths(tokens)
    for name in ("masks", "inference_logprobs", "advantages"):
        rows = group.get(name)
        if not isinstance(rows, list | CompactRows):
            continue
        if len(rows) > len(tokens):
            raise ValueError(f"{where}{name} has {len(rows)} rows for {len(tokens)} sequences")
        for i, (row, sequence) in enumerate(zip(row_lengths(rows), sequences, strict=False)):
            if row is not None and sequence is not None and row != sequence:
                raise ValueError(f"{where}{name}[{i}] has {row} entries for {sequence} tokens")


async def _store(request: Request) -> TrajectoryStore:  # async: a plain def would run in the thread pool
    return request.app.state.store


async def _calls(request: Request) -> RedisCalls:
    return request.app.state.calls


Store = Annotated[TrajectoryStore, Depends(_store)]
Calls = Annotated[RedisCalls, Depends(_calls)]


# the trainer's side -----------------------------------------------------------------------------------------
trainers = APIRouter()


@trainers.get("/")
async def root() -> dict[str, str]:
    return {"message": "AtroposLib API"}


@trainers.get("/healthz")
async def healthz(store: Store) -> dict[str, Any]:
    return {"status": "ok", **store.figures()}


@trainers.post("/register")
async def register(
    registration: Annotated[Registration, json_body(Registration)], store: Store, calls: Calls
) -> dict[str, Any]:
    return await calls(store.register, registration.model_dump())


@trainers.get("/wandb_info")
async def wandb_info(store: Store, calls: Calls) -> dict[str, Any]:
    return await calls(store.wandb_info)


@trainers.get("/info")
async def info(store: Store, calls: Calls) -> dict[str, Any]:
    return await calls(store.info)


@trainers.get("/batch")
async def batch(store: Store, calls: Calls) -> dict[str, Any]:
    return await calls(store.batch)


@trainers.get("/latest_example")
async def latest_example(store: Store, calls: Calls) -> Any:
    return await calls(store.latest_example)


@trainers.get("/status")
async def status(store: Store, calls: Calls) -> dict[str, Any]:
    return await calls(store.status)


@trainers.get("/reset_data")
async def reset_data(store: Store, calls: Calls) -> PlainTextResponse:
    await calls(store.reset)
    return PlainTextResponse("Reset successful")


# the environments' side -------------------------------------------------------------------------------------
envs = APIRouter()


@envs.post("/register-env")
async def register_env(
    fields: Annotated[RegisterEnv, json_body(RegisterEnv)], store: Store, calls: Calls
) -> dict[str, Any]:
    return await calls(store.register_env, fields.model_dump())


@envs.post("/disconnect-env")
async def disconnect_env(
    env: Annotated[EnvIdentifier, json_body(EnvIdentifier)], store: Store, calls: Calls
) -> dict[str, Any]:
    return await calls(store.disconnect_env, env.env_id)


def _within_token_length(store: TrajectoryStore, groups: list[dict[str, Any]]) -> None:
    """422 (counted) for a sequence past the ``max_token_len`` the trainer registered: it could not learn it."""
    limit = store.info()["max_token_len"]
    for g, group in enumerate(groups):
        for i, tokens in enumerate(row_lengths(group["tokens"])):
            if 0 < limit < (tokens or 0):
                store.refuse_invalid(len(groups))
                where = f"[{g}]" if len(groups) > 1 else ""
                raise _Refused(
                    f"body{where}.tokens[{i}] has {tokens} tokens; the trainer registered max_token_len {limit}"
                )


ONE_GROUP, GROUPS = TypeAdapter(ScoredData), TypeAdapter(Annotated[list[ScoredData], FAIL_FAST])


def _queue(
    store: TrajectoryStore, groups: list[dict[str, Any]], encoded: list[bytes]
) -> list[dict[str, Any]]:
    """The groups checked against the trainer's ``max_token_len``, then queued: one call to the store."""
    _within_token_length(store, groups)
    return store.post(groups, encoded)


def _stored(groups: list[ScoredData]) -> list[tuple[dict[str, Any], bytes]]:
    """Each group as the store takes it: its fields (the validated lists, not copies) and its JSON, made in the
    parsing thread (a big group's serialisation would hold the event loop for seconds)."""
    return [(fields, encode(fields)) for fields in map(dict, groups)]


async def _posted(
    request: Request, store: TrajectoryStore, calls: RedisCalls, listed: bool
) -> list[dict[str, Any]]:
    """The groups of a scored-data post, bounded as every body (``JSONBodies``), their fields lined up before they
    are validated; a refusal (422) counts the groups posted, queued (or buffered) otherwise."""
    posted = 1

    def check(parsed: Any) -> None:
        nonlocal posted
        if not listed:
            return lined_up(parsed)
        if isinstance(parsed, list):
            posted = max(1, len(parsed))
            for g, group in enumerate(parsed):
                lined_up(group, f"body[{g}].")

    bodies: JSONBodies = request.app.state.bodies
    reader: GroupReader = request.app.state.groups
    try:
        stored = await bodies.parse(
            request,
            GROUPS if listed else ONE_GROUP,
            check,
            lambda value: _stored(value if listed else [value]),
            functools.partial(reader.read, listed=listed),
        )
    except BodyError as error:
        if error.status == 422:
            await calls(store.refuse_invalid, posted)
        raise
    return await calls(_queue, store, [fields for fields, _ in stored], [encoded for _, encoded in stored])


@envs.post("/scored_data")
async def scored_data(request: Request, store: Store, calls: Calls) -> dict[str, Any]:
    return (await _posted(request, store, calls, listed=False))[0]


@envs.post("/scored_data_list")
async def scored_data_list(request: Request, store: Store, calls: Calls) -> dict[str, Any]:
    answers = await _posted(request, store, calls, listed=True)
    buffered = [a for a in answers if a["status"] == "buffered"]
    answer: dict[str, Any] = {"status": "received", "groups_processed": len(answers)}
    if buffered:
        answer |= {"buffered": len(buffered), "last_buffer_size": buffered[-1]["buffer_size"]}
    return answer


@envs.get("/status-env")
async def status_env(
    env: Annotated[EnvIdentifier, json_body(EnvIdentifier)], store: Store, calls: Calls
) -> Any:  # a GET with a JSON body, as atroposlib sends it
    answer = await calls(store.status_env, env.env_id)
    if answer is None:
        return JSONResponse(
            {"detail": f"env_id {env.env_id} is not registered (POST /register-env)"}, status_code=404
        )
    return answer


# errors -----------------------------------------------------------------------------------------------------
def _retry_later(request: Request, detail: str) -> JSONResponse:
    """503 with the ``Retry-After`` this API was built with."""
    return JSONResponse(
        {"detail": detail}, status_code=503, headers={"Retry-After": str(request.app.state.retry_after_s)}
    )


async def _redis_away(request: Request, error: redis.RedisError) -> JSONResponse:
    # an error ``RedisCalls`` does not answer itself (a refused command: out of memory, a read-only replica); it
    # marked the store stale (a write may have failed half-way in the mirror)
    log.warning("Redis unavailable during %s: %s", request.url.path, error)
    return _retry_later(request, f"the state store (Redis) is unavailable: {error}")


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
    # one thread: the store's mirror is changed by one request at a time
    app.state.calls = RedisCalls("atropos-api-redis", 1, retry_after_s=retry_after_s, failed=store.read_back)
    app.state.bodies = JSONBodies("atropos.max_request_mb")
    app.state.groups = GroupReader(tuple(ScoredData.model_fields), max_request_bytes)
    app.add_middleware(GZipMiddleware, minimum_size=1000)  # batches are large: gzip answers to who accepts it
    app.add_middleware(GzipRequests, limit=max_request_bytes, setting="atropos.max_request_mb")
    app.add_middleware(BodyLimit, limit=max_request_bytes, setting="atropos.max_request_mb")
    if api_keys:
        app.add_middleware(
            APIKeys, keys=[k.encode() for k in api_keys], open_paths=frozenset({"/", "/healthz"})
        )
    for error, handler in (
        (redis.RedisError, _redis_away),
        (BodyError, body_error),
        (_Refused, _refused),
        (QueueFull, _queue_full),
    ):
        app.add_exception_handler(error, handler)
    app.include_router(trainers)
    app.include_router(envs)
    return app
