"""The Tinker API sampling process's samplers: a new sampler asked for by many requests at once (a client's group,
one request per sample, as the Tinker Cookbook's RL loop sends them) is loaded from its weights file once, and a
load that fails fails each request that waited for it, leaving the next one free to try again."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tinker_atropos.config import parse_config
from tinker_atropos.tinker_api.engine.sampling_process import Job, Samplers, Settings


def samplers(load: object) -> Samplers:
    config = parse_config({})
    settings = Settings(config.trainer.model, "cpu", 0, config.trainer.tinker)
    made = Samplers(settings, training=None, stopping=threading.Event())  # type: ignore[arg-type]
    made._load = load  # type: ignore[method-assign]
    return made


def job(key: str) -> Job:
    return Job(key, "tiny-byte-lm", f"/weights/{key}.pt", b"{}", time.monotonic() + 60, 60)


def test_a_sampler_asked_for_by_many_requests_at_once_is_loaded_once() -> None:
    loads: list[str] = []

    def load(asked: Job) -> object:
        loads.append(asked.key)
        time.sleep(0.3)  # the others ask while it loads
        return object()

    made = samplers(load)
    with ThreadPoolExecutor(16) as pool:
        models = list(pool.map(made.model, [job("s1")] * 16 + [job("s2")] * 4))
    assert sorted(loads) == ["s1", "s2"]
    assert len({id(m) for m in models[:16]}) == 1 and models[0] is not models[16]
    assert made.model(job("s1")) is models[0] and not made.loading  # kept; nothing left loading


def test_a_failed_load_fails_its_waiters_and_the_next_request_loads_again() -> None:
    calls: list[int] = []

    def load(asked: Job) -> object:
        calls.append(1)
        time.sleep(0.2)
        if len(calls) == 1:
            raise FileNotFoundError(asked.file)
        return object()

    made = samplers(load)
    with ThreadPoolExecutor(4) as pool:
        outcomes = [pool.submit(made.model, job("s1")) for _ in range(4)]
        for outcome in outcomes:
            with pytest.raises(FileNotFoundError):
                outcome.result()
    assert made.model(job("s1")) is not None and len(calls) == 2
