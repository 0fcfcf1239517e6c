"""Tenants side by side on one Tinker API (``python -m bench tenants``, ``make bench-tenants``): one client floods
the sampler with long samples while another asks for short ones, timed as each client sees it through the tinker
SDK; then the flooder is SIGKILLed and fresh clients are timed, and the time until its queue is cancelled. The
floors of tenant isolation: a newcomer's 8-token sample within 2 s at p95 (tiny LM, 2 cores) while 200 samples
of 4 x 500 tokens are queued; fresh clients answered within 10 s of a flooder's SIGKILL."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import redis
import tinker
from tinker import types

from bench.tinker_server import serving
from tinker_atropos.config import TinkerSection

LM = "tiny-byte-lm"
FLOODER = textwrap.dedent("""
    import sys, time, tinker
    from tinker import types
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    sampler = service.create_sampling_client(base_model=sys.argv[3]).result(timeout=60)
    params = types.SamplingParams(max_tokens=int(sys.argv[5]), stop=[], temperature=1.0)
    prompt = types.ModelInput.from_ints([1, 70, 108, 111, 111, 100])
    futures = [sampler.sample(prompt, num_samples=4, sampling_params=params) for _ in range(int(sys.argv[4]))]
    print(sampler._sampling_session_id, flush=True)
    time.sleep(3600)
""")


TIMEOUT_S = 60.0  # a sample not answered by then counts as this long, and the client stops asking


def _sample_s(sampler: tinker.SamplingClient, max_tokens: int) -> float:
    started = time.monotonic()
    params = types.SamplingParams(max_tokens=max_tokens, stop=[])
    try:
        sampler.sample(types.ModelInput.from_ints([1, 104, 105]), 1, params).result(timeout=TIMEOUT_S)
    except TimeoutError:
        return TIMEOUT_S
    return time.monotonic() - started


def _samples_s(sampler: tinker.SamplingClient, count: int) -> list[float]:
    """Up to ``count`` short samples' times, one after another, until one times out."""
    times: list[float] = []
    while len(times) < count and (not times or times[-1] < TIMEOUT_S):
        times.append(_sample_s(sampler, 8))
    return times


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def run(
    out: Path, flood: int = 200, flood_tokens: int = 500, samples: int = 20, session_timeout_s: float = 15
) -> dict:
    """Measure, write ``out/bench-tenants.json`` and return it."""
    settings: dict[str, float] = {"session_timeout_s": session_timeout_s}
    if "max_queued_requests" in TinkerSection.model_fields:  # absent from the code before tenants took turns
        settings["max_queued_requests"] = max(256, flood)
    with serving(out / "tenants-server", settings, key="tml-bench-0123456789abcdef") as served:
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, served.url, served.key, LM, str(flood), str(flood_tokens)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flooder.stdout is not None
        session = flooder.stdout.readline().strip().split(":")[0]
        client = tinker.ServiceClient(base_url=served.url, api_key=served.key)
        sampler = client.create_sampling_client(base_model=LM).result(timeout=60)
        time.sleep(5)  # the flood queued and decoding
        store = redis.Redis.from_url(served.redis_url)
        unanswered = [_unanswered(store, session)]
        during = _samples_s(sampler, samples)
        unanswered.append(_unanswered(store, session))
        flooder.kill()
        flooder.wait()
        killed = time.monotonic()
        fresh = []
        for _ in range(5):
            other = tinker.ServiceClient(base_url=served.url, api_key=served.key)
            fresh += _samples_s(other.create_sampling_client(base_model=LM).result(timeout=60), 1)
            other.close("success").result(timeout=30)
        log = out / "tenants-server" / "trainer.log"
        while f"{session} ended: " not in log.read_text() and time.monotonic() - killed < 120:
            time.sleep(0.2)
        cancelled_s = time.monotonic() - killed if f"{session} ended: " in log.read_text() else None
        client.close("success").result(timeout=30)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "settings": {
            "model": LM,
            "flood": f"{flood} concurrent sample(num_samples=4, max_tokens={flood_tokens}, stop=[]) of one client",
            "newcomer": "sample(num_samples=1, max_tokens=8, stop=[]) of another client, one after another",
            "trainer.tinker": {**settings, "max_running_samples": 64, "kv_cache_tokens": 32768},
        },
        "flood_unanswered_before_and_after_the_newcomer": unanswered,
        "newcomer_s": {
            "p50": statistics.median(during),
            "p95": _p95(during),
            "max": max(during),
            "all": during,
        },
        "after_flooder_sigkill": {"fresh_clients_max_s": max(fresh), "all": fresh},
        "flood_cancelled_after_s": cancelled_s,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-tenants.json").write_text(json.dumps(result, indent=2))
    return result


def _unanswered(store: redis.Redis, session: str) -> int:
    """The flooder's sample requests still pending (their futures' status), however the server queues them."""
    pending = 0
    for key in store.scan_iter(match="ta:bench-tinker:tinker:future:*", count=1000):
        status, sampler = store.hmget(key, ["status", "body"])
        pending += status == b"pending" and sampler is not None and session.encode() in sampler
    return pending
