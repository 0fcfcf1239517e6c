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
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from tinker_atropos.frontends.http import APIKeys, BodyLimit
from tinker_atropos.frontends.inference.sampler import Completion, Sampler
from tinker_atropos.models.tiny_lm import chat_prompt


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields a sampler has no use for

    model: str = ""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def build_app(
    sampler: Sampler, model_name: str, api_keys: list[str], max_request_bytes: int = 8 << 20
) -> FastAPI:
    """The endpoint; ``api_keys`` empty: no key asked (an ``--insecure`` run)."""
    app = FastAPI(title="tinker-atropos inference", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes, setting="the inference endpoint's 8 MiB")
    if api_keys:
        app.add_middleware(APIKeys, keys=[k.encode() for k in api_keys], open_paths=frozenset({"/health"}))
    tokenizer = sampler.tokenizer

    def generate(prompt: list[int], request: _Sampling, max_tokens: int, stop_ids: list[int] = ()) -> list[Completion]:  # fmt: skip
        if not prompt:
            raise HTTPException(400, "the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size:
            raise HTTPException(400, f"prompt tokens must lie in [0, {tokenizer.vocab_size})")
        try:
            return sampler.generate(prompt, n=request.n, max_tokens=max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, top_k=request.top_k, stop_tokens=stop_ids,
                                    stop_strings=_stops(request.stop), seed=request.seed)  # fmt: skip
        except ValueError as error:
            raise HTTPException(400, str(error)) from None

    def envelope(kind: str, choices: list[dict[str, Any]], prompt: list[int], done: list[Completion]) -> dict[str, Any]:  # fmt: skip
        generated = sum(len(c.tokens) for c in done)
        return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": model_name, "choices": choices, "policy_version": done[0].policy_version,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                          "total_tokens": len(prompt) + generated}}  # fmt: skip

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "policy_version": sampler.version}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "tinker-atropos",
                                            "policy_version": sampler.version}]}  # fmt: skip

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, Any]:
        prompt = (
            request.prompt
            if isinstance(request.prompt, list)
            else tokenizer.encode(request.prompt, add_bos=True)
        )
        done = generate(prompt, request, request.max_tokens)
        choices = []
        for i, c in enumerate(done):
            logprobs = None
            if request.logprobs is not None:
                texts = [tokenizer.decode([t]) for t in c.tokens]
                offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
                logprobs = {"tokens": texts, "token_logprobs": c.logprobs, "top_logprobs": None,
                            "text_offset": offsets, "token_ids": c.tokens}  # fmt: skip
            choices.append({"index": i, "text": tokenizer.decode(c.tokens), "logprobs": logprobs,
                            "finish_reason": c.finish_reason})  # fmt: skip
        return envelope("text_completion", choices, prompt, done)

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest) -> dict[str, Any]:
        text = chat_prompt([(m.role, m.content) for m in request.messages])
        prompt = tokenizer.encode(text, add_bos=True)
        done = generate(prompt, request, request.max_completion_tokens or request.max_tokens)
        choices = []
        for i, c in enumerate(done):
            logprobs = None
            if request.logprobs:
                logprobs = {"content": [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": [t] if t < 256 else [],
                                         "top_logprobs": []} for t, lp in zip(c.tokens, c.logprobs, strict=True)]}  # fmt: skip
            choices.append({"index": i, "message": {"role": "assistant", "content": tokenizer.decode(c.tokens)},
                            "logprobs": logprobs, "finish_reason": c.finish_reason})  # fmt: skip
        return envelope("chat.completion", choices, prompt, done)

    @app.post("/generate")
    def sglang_generate(request: GenerateRequest) -> Any:
        params = request.sampling_params
        if request.input_ids is None and request.text is None:
            raise HTTPException(400, "give input_ids or text")
        prompt = (
            request.input_ids
            if request.input_ids is not None
            else tokenizer.encode(request.text, add_bos=True)
        )
        try:
            sampling = _Sampling(max_tokens=params.get("max_new_tokens", 128), temperature=params.get("temperature", 1.0),
                                 top_p=params.get("top_p", 1.0), top_k=params.get("top_k", -1), n=params.get("n", 1),
                                 stop=params.get("stop"), seed=params.get("seed"))  # fmt: skip
        except ValueError as error:
            raise HTTPException(400, f"sampling_params: {error}") from None
        done = generate(prompt, sampling, sampling.max_tokens, list(params.get("stop_token_ids") or []))
        answers = []
        for c in done:
            meta = {"prompt_tokens": len(prompt), "completion_tokens": len(c.tokens),
                    "finish_reason": {"type": c.finish_reason}, "policy_version": c.policy_version}  # fmt: skip
            if request.return_logprob:
                meta["output_token_logprobs"] = [
                    [lp, t, None] for t, lp in zip(c.tokens, c.logprobs, strict=True)
                ]
            answers.append({"text": tokenizer.decode(c.tokens), "output_ids": c.tokens, "meta_info": meta})
        return answers if sampling.n > 1 else answers[0]

    return app
