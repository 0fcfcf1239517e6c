"""Sampling sessions and samples (queued to the sampler's lane; the sequences' ids handed out at once)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from tinker import types

from tinker_atropos.tinker_api.http.routes.shared import JSON_VALUES, HTTPError, Shared
from tinker_atropos.tinker_api.store.queue import QueueFull
from tinker_atropos.tinker_api.store.samplers import sampler_lane
from tinker_atropos.tinker_api.store.sequences import sequence_ids

sampling = APIRouter()
# the most top-k log-probs a position may ask for: vLLM's default max_logprobs, and the K the cookbook's distillation
# recipes use (each of a prompt's positions costs k ids and log-probs in the response)
MAX_TOPK = 20


@sampling.post("/create_sampling_session")
async def create_sampling_session(request: Request, api: Shared) -> dict[str, Any]:
    body = await api.parse(types.CreateSamplingSessionRequest, await request.body())
    await api.session(body.session_id)
    if body.model_path is not None:
        base_model = (await api.checkpoint_record(body.model_path))["base_model"]
    else:
        base_model = api.served(body.base_model)
    sampler = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    await api.redis(api.store.samplers.add, sampler, base_model, body.model_path)
    return {"type": "create_sampling_session", "sampling_session_id": sampler}


@sampling.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, api: Shared) -> dict[str, Any]:
    found = await api.redis(api.store.samplers.get, sampler_id)
    if found is None:
        raise HTTPError(404, f"no sampling session {sampler_id!r}")
    return {"sampler_id": sampler_id, "base_model": found[0], "model_path": found[1]}


@sampling.post("/asample")
async def asample(request: Request, api: Shared) -> dict[str, Any]:
    raw = await request.body()
    tokens_and_more = api.max_request_tokens + JSON_VALUES  # the prompt's tokens are values
    body = await api.parse(types.SampleRequest, raw, tokens_and_more)
    found = None
    if body.sampling_session_id is not None:
        found = await api.redis(api.store.samplers.get, body.sampling_session_id)
    if found is None:
        raise HTTPError(404, f"no sampling session {body.sampling_session_id!r}")
    if not 1 <= body.num_samples <= 64:
        raise HTTPError(400, f"num_samples must lie in [1, 64], got {body.num_samples}")
    check_logprob_options(body)
    tokens = body.num_samples * (body.prompt.length + (body.sampling_params.max_tokens or 16))
    if tokens > api.max_request_tokens:
        raise HTTPError(
            400,
            f"num_samples x (prompt + max_tokens) is {tokens} tokens; a request may take "
            f"{api.max_request_tokens} (trainer.tinker.max_request_tokens)",
        )
    session = body.sampling_session_id.split(":")[0]  # create_sampling_session names it so
    await api.session(session)  # a finished session's sampler samples no more
    dedup = f"sample:{body.sampling_session_id}:{body.seq_id}" if body.seq_id is not None else None
    try:
        request_id = await api.redis(
            api.store.requests.submit,
            "sample",
            raw,
            dedup=dedup,
            lane=sampler_lane(*found),
            tenant=session,
            max_queued=api.max_queued_requests,
        )
    except QueueFull as error:
        raise HTTPError(
            429, f"{error}: wait for some to finish (trainer.tinker.max_queued_requests per session)"
        ) from None
    return api.queued(request_id, sample_sequence_ids=sequence_ids(request_id, body.num_samples))


def check_logprob_options(body: types.SampleRequest) -> None:
    """400, naming the field, for log-prob options out of range or not served (``prompt_alt_tokens_k`` and
    ``target_prompt_logprobs``, which the SDK would otherwise find missing only once the sample is done)."""
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(body, name)
        if not 0 <= k <= MAX_TOPK:
            raise HTTPError(400, f"{name} must lie in [0, {MAX_TOPK}], got {k}")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise HTTPError(400, "prompt_logprobs_last_n applies to prompt log-probs: set prompt_logprobs")
        if not 1 <= last_n <= body.prompt.length - 1:
            raise HTTPError(
                400,
                f"prompt_logprobs_last_n must lie in [1, {body.prompt.length - 1}] (the prompt's length - 1), "
                f"got {last_n}",
            )
    if body.prompt_alt_tokens_k:
        raise HTTPError(400, "prompt_alt_tokens_k is not served by this trainer (top-k prompt log-probs are)")
    if body.target_prompt_logprobs is not None:
        raise HTTPError(
            400, "target_prompt_logprobs is not served by this trainer (prompt_logprobs and their top-k are)"
        )
