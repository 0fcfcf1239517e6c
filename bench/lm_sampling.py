"""Sampling SmolLM2-135M-Instruct through the tinker SDK, many clients at once: the aggregate
tokens/s of ``CLIENTS`` clients each asking ``SAMPLES`` x ``TOKENS`` tokens at the same moment against one such
client alone, and against Hugging Face ``generate`` given all ``CLIENTS`` x ``SAMPLES`` sequences as one static
batch (its KV cache) in this process, with the threads of the trainer's sampling process. Every sample runs to
``TOKENS`` (``stop=[]``), so each side produces the same tokens. Time to first token is read from an engine in this
process fed the same requests at once (the SDK returns whole samples)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.tinker_server import serving
from tinker_atropos.models import smollm2
from tinker_atropos.sampling.engine import Engine
from tinker_atropos.sampling.params import Params

CLIENTS, SAMPLES, TOKENS, PROMPT, ROUNDS = 16, 4, 64, 32, 3


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 49152, size=PROMPT).tolist() for _ in range(count)]


def through_sdk(url: str, key: str, count: int) -> dict[str, Any]:
    """``count`` clients (each its own ServiceClient and sampling session) sampling at once; wall time and each
    request's latency."""
    import tinker
    from tinker import types

    services = [tinker.ServiceClient(base_url=url, api_key=key) for _ in range(count)]
    samplers = [s.create_sampling_client(base_model=smollm2.NAME).result(timeout=600) for s in services]
    params = types.SamplingParams(max_tokens=TOKENS, temperature=1.0, stop=[])
    asked = prompts(count)
    samplers[0].sample(types.ModelInput.from_ints(asked[0]), 1, types.SamplingParams(max_tokens=2)).result(
        timeout=600
    )
    latencies: list[float] = [0.0] * count
    start = threading.Barrier(count + 1)

    def one(i: int) -> None:
        start.wait()
        begun = time.perf_counter()
        out = samplers[i].sample(types.ModelInput.from_ints(asked[i]), SAMPLES, params).result(timeout=1800)
        assert all(len(s.tokens) == TOKENS for s in out.sequences)
        latencies[i] = time.perf_counter() - begun

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    start.wait()
    begun = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begun
    for service in services:
        service.close("success").result(timeout=60)
    return {
        "clients": count,
        "tokens": count * SAMPLES * TOKENS,
        "wall_s": wall,
        "tokens_per_s": count * SAMPLES * TOKENS / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
    }


def hf_static_batch(threads: int) -> dict[str, Any]:
    """``generate`` over all the sequences as one batch: CLIENTS prompts x SAMPLES return sequences."""
    model = smollm2.load()
    torch.set_num_threads(threads)
    batch = torch.tensor(prompts(CLIENTS))
    with torch.inference_mode():
        model.hf.generate(batch[:1], do_sample=True, max_new_tokens=2, pad_token_id=model.eos_id)  # warm-up
        begun = time.perf_counter()
        out = model.hf.generate(
            batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            num_return_sequences=SAMPLES,
            pad_token_id=model.eos_id,
        )
        wall = time.perf_counter() - begun
    assert out.shape == (CLIENTS * SAMPLES, PROMPT + TOKENS)
    return {"sequences": CLIENTS * SAMPLES, "wall_s": wall, "tokens_per_s": CLIENTS * SAMPLES * TOKENS / wall}


def first_tokens(threads: int) -> dict[str, Any]:
    """Time to first token of CLIENTS requests submitted at once to an engine of this process (the trainer's
    defaults: its prefill chunk and key-value budget)."""
    from tinker_atropos.config import TinkerSection

    section = TinkerSection()
    torch.set_num_threads(threads)
    engine = Engine(
        smollm2.load(), kv_tokens=section.kv_cache_tokens, prefill_chunk=section.prefill_chunk_tokens
    )
    engine.start()
    try:
        begun = time.perf_counter()
        params = Params(TOKENS, SAMPLES, stop_tokens=frozenset())
        futures = [engine.submit(p, params) for p in prompts(CLIENTS)]
        for future in futures:
            future.result(timeout=1800)
        wall = time.perf_counter() - begun
    finally:
        engine.close()
    firsts = list(engine.first_token_s)
    return {
        "wall_s": wall,
        "tokens_per_s": CLIENTS * SAMPLES * TOKENS / wall,
        "ttft_p50_s": float(np.percentile(firsts, 50)),
        "ttft_p95_s": float(np.percentile(firsts, 95)),
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tokens/s, with every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda run: run["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "rounds_tokens_per_s": [run["tokens_per_s"] for run in runs]}


def run(work: Path, threads: int | None = None) -> dict[str, Any]:
    """One client alone, then CLIENTS at once, through the SDK; the static batch and the first tokens here, with
    as many threads as the trainer's sampling process (``threads`` None: every core)."""
    threads = threads or len(os.sched_getaffinity(0))
    with serving(work, {"max_running_samples": 64}) as served:
        # alternating, the median round of each: this machine's speed drifts within a run
        rounds = [
            (through_sdk(served.url, served.key, 1), through_sdk(served.url, served.key, CLIENTS))
            for _ in range(ROUNDS)
        ]
    alone, together = (_median([r[side] for r in rounds]) for side in (0, 1))
    static = hf_static_batch(threads)
    engine = first_tokens(threads)
    return {
        "model": smollm2.NAME,
        "torch_threads": threads,
        "samples": SAMPLES,
        "max_tokens": TOKENS,
        "prompt_tokens": PROMPT,
        "alone": alone,
        "together": together,
        "hf_static_batch": static,
        "engine_in_process": engine,
        "together_vs_alone": together["tokens_per_s"] / alone["tokens_per_s"],
        "together_vs_hf_static": together["tokens_per_s"] / static["tokens_per_s"],
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out/lm-sampling")), indent=2))
