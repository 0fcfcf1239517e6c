"""The inference endpoint's sampler: stop strings end a completion where its decoded text first holds one."""

from __future__ import annotations

from tinker_atropos.frontends.inference.sampler import Sampler
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyCausalLM, TinyLMConfig

TOK = ByteTokenizer()


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it() -> None:
    sampler = Sampler(TinyCausalLM(TinyLMConfig()), version=2)
    prompt = TOK.encode("ab", add_bos=True)
    settings = {
        "n": 3,
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_tokens": [],
        "seed": 7,
    }
    free = sampler.generate(prompt, stop_strings=[], **settings)
    assert len(free[0].tokens) > 3
    stop = TOK.decode(free[0].tokens[1:3])
    ended = sampler.generate(prompt, stop_strings=[stop], **settings)
    for before, after in zip(free, ended, strict=True):
        end = next(
            (i for i in range(1, len(before.tokens) + 1) if stop in TOK.decode(before.tokens[:i])), None
        )
        assert after.tokens == before.tokens[:end] and after.logprobs == before.logprobs[:end]
        assert after.finish_reason == (before.finish_reason if end is None else "stop")
        assert after.policy_version == 2
    assert len(ended[0].tokens) <= 3
