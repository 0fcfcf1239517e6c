"""The inference endpoint's routes, in the shapes Atropos environments call:

- ``POST /v1/completions`` and ``/v1/chat/completions``, OpenAI's (``openai`` clients, atroposlib's
  ``OpenAIServer``), with token log-probs when asked (``logprobs``);
- ``POST /generate``, SGLang's native route with ``input_ids`` (atroposlib's ``SGLangServer``, which its
  ``ManagedServer`` uses for exact tokens and log-probs): ``meta_info.output_token_logprobs`` as
  ``[logprob, token id, null]`` triples, one answer per sample (a list when ``n`` > 1);
- ``GET /v1/models``, ``/health``.

Every answer carries ``policy_version``, the trainer's version of the weights that sampled it. A request the
model cannot serve (a prompt past the context, a bad parameter) is a 400 with a message. Every route but
``/health`` asks the run's key, as OpenAI clients send it (``Authorization: Bearer``; atroposlib's servers send
their ``api_key`` so).

A router per shape (the service's status, OpenAI's, SGLang's), each reaching the sampler through the ``Endpoint``
dependency; the routes are plain functions, run in FastAPI's thread pool while the model samples, but ``/health``,
answered on the event loop whatever that pool is busy with. No route touches Redis.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tinker_atropos.frontends.bodies import BodyError, BodyLimit, JSONBodies, body_error, json_body
from tinker_atropos.frontends.http import APIKeys
from tinker_atropos.frontends.inference.sampler import Completion, Sampler
from tinker_atropos.sampling.inbox import Stopped

# what a request may hold, checked as it is validated (a longer list stops there): no model served here reads
# more tokens than this, nor an OpenAI server more stop strings or messages
MAX_PROMPT_TOKENS, MAX_STOPS, MAX_MESSAGES = 1 << 16, 16, 4096
# JSON values in a body, checked before it is parsed: a prompt's tokens and as many others (a million numbers
# would take 40 MB parsed, before a validation refused the list)
MAX_VALUES = 2 * MAX_PROMPT_TOKENS


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields a sampler has no use for

    model: str = ""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(1, ge=1, le=64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = None
    # OpenAI's end-user id: the running batch takes users in turn, least-served first (sampling/scheduler.py)
    user: str = Field("", max_length=256)


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS, fail_fast=True)]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES, fail_fast=True)]
    logprobs: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_ids: Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS, fail_fast=True)] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


@dataclass(frozen=True)
class Endpoint:
    """What the routes share: the sampler and the name its model is served under."""

    sampler: Sampler
    model_name: str

    def encode(self, text: str) -> list[int]:
        """``text``'s tokens, with the BOS the model expects; a 400 before encoding a text the tokenizer knows
        cannot fit the context (the byte tokenizer makes a token of every character at least): as a list of
        tokens, a long text would take sixteen times its size."""
        fewest = self.sampler.tokenizer.fewest_tokens(text)
        if fewest > self.sampler.max_seq_len:
            raise HTTPException(
                400, f"the prompt has at least {fewest} tokens; the context is {self.sampler.max_seq_len}"
            )
        return self.sampler.tokenizer.encode(text)

    def generate(
        self, prompt: list[int], request: _Sampling, max_tokens: int, stop_ids: list[int] = ()
    ) -> list[Completion]:
        tokenizer = self.sampler.tokenizer
        if not prompt:
            raise HTTPException(400, "the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size:
            raise HTTPException(400, f"prompt tokens must lie in [0, {tokenizer.vocab_size})")
        try:
            return self.sampler.generate(
                prompt,
                n=request.n,
                max_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                stop_tokens=stop_ids,
                stop_strings=_stops(request.stop),
                seed=request.seed,
                tenant=request.user,
            )
        except ValueError as error:
            raise HTTPException(400, str(error)) from None

    def envelope(
        self, kind: str, choices: list[dict[str, Any]], prompt: list[int], done: list[Completion]
    ) -> dict[str, Any]:
        generated = sum(len(c.tokens) for c in done)
        return {
            "id": f"{kind}-{uuid.uuid4().hex[:24]}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "policy_version": done[0].policy_version,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": generated,
                "total_tokens": len(prompt) + generated,
            },
        }


async def _endpoint(request: Request) -> Endpoint:  # async: read on the event loop, not in the thread pool
    return request.app.state.endpoint


Shared = Annotated[Endpoint, Depends(_endpoint)]

# the service's status ----------------------------------------------------------------------------------------
status_routes = APIRouter()


@status_routes.get("/health")
async def health(endpoint: Shared) -> dict[str, Any]:
    """On the event loop: answered while every thread of the pool samples."""
    return {"status": "ok", "policy_version": endpoint.sampler.version}


@status_routes.get("/v1/models")
def models(endpoint: Shared) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": endpoint.model_name,
                "object": "model",
                "owned_by": "tinker-atropos",
                "max_model_len": endpoint.sampler.max_seq_len,
                "policy_version": endpoint.sampler.version,
            }
        ],
    }


# OpenAI's completions ----------------------------------------------------------------------------------------
openai_routes = APIRouter()


@openai_routes.post("/v1/completions")
def completions(
    request: Annotated[CompletionRequest, json_body(CompletionRequest)], endpoint: Shared
) -> dict[str, Any]:
    tokenizer = endpoint.sampler.tokenizer
    prompt = request.prompt if isinstance(request.prompt, list) else endpoint.encode(request.prompt)
    done = endpoint.generate(prompt, request, request.max_tokens)
    choices = []
    for i, c in enumerate(done):
        logprobs = None
        if request.logprobs is not None:
            texts = [tokenizer.decode([t]) for t in c.tokens]
            offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
            logprobs = {
                "tokens": texts,
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
                "token_ids": c.tokens,
            }
        choices.append(
            {
                "index": i,
                "text": tokenizer.decode(c.tokens),
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return endpoint.envelope("text_completion", choices, prompt, done)


@openai_routes.post("/v1/chat/completions")
def chat_completions(
    request: Annotated[ChatRequest, json_body(ChatRequest)], endpoint: Shared
) -> dict[str, Any]:
    tokenizer = endpoint.sampler.tokenizer
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    if sum(tokenizer.fewest_tokens(m["content"]) for m in messages) > endpoint.sampler.max_seq_len:
        raise HTTPException(
            400, f"the conversation has more tokens than the context ({endpoint.sampler.max_seq_len})"
        )
    try:
        prompt = tokenizer.chat(messages)
    except ValueError as error:
        raise HTTPException(400, str(error)) from None
    done = endpoint.generate(prompt, request, request.max_completion_tokens or request.max_tokens)
    choices = []
    for i, c in enumerate(done):
        logprobs = None
        if request.logprobs:
            logprobs = {
                "content": [
                    {
                        "token": tokenizer.decode([t]),
                        "logprob": lp,
                        "bytes": tokenizer.token_bytes(t),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(c.tokens, c.logprobs, strict=True)
                ]
            }
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": tokenizer.decode(c.tokens)},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return endpoint.envelope("chat.completion", choices, prompt, done)


# SGLang's native route ---------------------------------------------------------------------------------------
sglang_routes = APIRouter()


@sglang_routes.post("/generate")
def sglang_generate(request: Annotated[GenerateRequest, json_body(GenerateRequest)], endpoint: Shared) -> Any:
    tokenizer = endpoint.sampler.tokenizer
    params = request.sampling_params
    if request.input_ids is None and request.text is None:
        raise HTTPException(400, "give input_ids or text")
    prompt = request.input_ids if request.input_ids is not None else endpoint.encode(request.text)
    try:
        sampling = _Sampling(
            max_tokens=params.get("max_new_tokens", 128),
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", -1),
            n=params.get("n", 1),
            stop=params.get("stop"),
            seed=params.get("seed"),
        )
    except ValueError as error:
        raise HTTPException(400, f"sampling_params: {error}") from None
    done = endpoint.generate(prompt, sampling, sampling.max_tokens, list(params.get("stop_token_ids") or []))
    answers = []
    for c in done:
        meta = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(c.tokens),
            "finish_reason": {"type": c.finish_reason},
            "policy_version": c.policy_version,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(c.tokens, c.logprobs, strict=True)
            ]
        answers.append({"text": tokenizer.decode(c.tokens), "output_ids": c.tokens, "meta_info": meta})
    return answers if sampling.n > 1 else answers[0]


SETTING = "trainer.atropos.inference_max_request_mb"


async def stopping(request: Request, error: Stopped) -> JSONResponse:
    """A request the trainer's stop leaves unanswered (its engines close before the endpoint): 503, which an
    environment retries against the restarted trainer, not a 500 and a traceback in the trainer's log."""
    return JSONResponse(
        {"detail": f"the trainer is stopping: {error}"}, status_code=503, headers={"Retry-After": "5"}
    )


def build_app(sampler: Sampler, model_name: str, api_keys: list[str], max_request_bytes: int) -> FastAPI:
    """The endpoint; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(title="tinker-atropos inference", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.endpoint = Endpoint(sampler, model_name)
    app.state.bodies = JSONBodies(SETTING, max_values=MAX_VALUES)
    app.add_exception_handler(BodyError, body_error)
    app.add_exception_handler(Stopped, stopping)
    app.add_middleware(BodyLimit, limit=max_request_bytes, setting=SETTING)
    if api_keys:
        app.add_middleware(APIKeys, keys=[k.encode() for k in api_keys], open_paths=frozenset({"/health"}))
    for router in (status_routes, openai_routes, sglang_routes):
        app.include_router(router)
    return app
