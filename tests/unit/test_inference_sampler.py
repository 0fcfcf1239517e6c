"""The inference endpoint's sampler: stop strings end a completion where its decoded text first holds one;
concurrent requests share one running batch, each finishing with the policy version it started with."""

from __future__ import annotations

import threading

import torch

from tinker_atropos.frontends.inference.sampler import Sampler
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyCausalLM, TinyLMConfig

TOK = ByteTokenizer()
SETTINGS = {"max_tokens": 24, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_tokens": [], "seed": 7}


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it() -> None:
    sampler = Sampler(TinyCausalLM(TinyLMConfig()), version=2)
    prompt = TOK.encode("ab", add_bos=True)
    try:
        free = sampler.generate(prompt, n=3, stop_strings=[], **SETTINGS)
        assert len(free[0].tokens) > 3
        stop = TOK.decode(free[0].tokens[1:3])
        ended = sampler.generate(prompt, n=3, stop_strings=[stop], **SETTINGS)
    finally:
        sampler.close()
    for before, after in zip(free, ended, strict=True):
        end = next(
            (i for i in range(1, len(before.tokens) + 1) if stop in TOK.decode(before.tokens[:i])), None
        )
        assert after.tokens == before.tokens[:end]
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(before.logprobs[:end]))
        assert after.finish_reason == (before.finish_reason if end is None else "stop")
        assert after.policy_version == 2
    assert len(ended[0].tokens) <= 3


def test_concurrent_requests_share_a_batch_and_keep_the_version_they_started_with() -> None:
    model = TinyCausalLM(TinyLMConfig())
    sampler = Sampler(model, version=1)
    prompt = TOK.encode("ab", add_bos=True)
    alone = sampler.generate(prompt, n=2, stop_strings=[], **{**SETTINGS, "max_tokens": 200})
    first = sampler._engine
    results: dict[int, list] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, sampler.generate(prompt, n=2, stop_strings=[], **{**SETTINGS, "max_tokens": 200})
            )
        )
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    while len(first.rows.requests) + len(first.reading) + len(first.waiting) < 3:
        threading.Event().wait(0.001)  # all three in the first version's engine
    with torch.no_grad():
        model.lm_head.bias.add_(
            torch.randn(model.lm_head.bias.shape, generator=torch.Generator().manual_seed(0))
        )
    sampler.update(model, version=2)  # while they decode
    for thread in threads:
        thread.join(60)
    assert first.closed and not sampler._retired  # the old version's engine closed once it answered
    try:
        later = sampler.generate(prompt, n=2, stop_strings=[], **{**SETTINGS, "max_tokens": 200})
    finally:
        sampler.close()
    assert sorted(results) == [0, 1, 2]  # every one answered: none failed as the old engine closed
    for result in results.values():  # the first version's, as they were submitted
        assert [c.policy_version for c in result] == [1, 1]
        assert [c.tokens for c in result] == [c.tokens for c in alone]
    assert [c.policy_version for c in later] == [2, 2]
    assert [c.tokens for c in later] != [c.tokens for c in alone]
