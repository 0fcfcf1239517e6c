"""The sampling engine: a request's samples (seeded, their log-probabilities those of what was sampled from,
stopped by tokens, strings and lengths), and continuous batching: requests that join a running batch, of other
adapters, prompt lengths and chunkings, get exactly what they get alone; the key-value budget makes requests wait,
never overflow; deadlines and closing fail only what they name."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from tinker_atropos.models import lora, tiny_lm
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyCausalLM
from tinker_atropos.sampling.engine import Cancelled, Engine, Stopped, sample
from tinker_atropos.sampling.params import Params, SampledTokens, stop_strings
from tinker_atropos.sampling.request_state import Request

TOK = ByteTokenizer()
EOS = frozenset({TOK.eos_id})


def draw(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    stop: frozenset[int] = EOS,
    **params: object,
) -> list[SampledTokens]:
    return sample(model, prompt, Params(max_tokens, stop_tokens=stop, **params))  # type: ignore[arg-type]


def _as_alone(futures: Sequence[Future[list[SampledTokens]]], alone: Sequence[list[SampledTokens]]) -> None:
    """Each request got the samples it draws alone: tokens, why they stopped, log-probs."""
    for future, want in zip(futures, alone, strict=True):
        got = future.result()
        assert [s.tokens for s in got] == [s.tokens for s in want]
        assert [s.stop_reason for s in got] == [s.stop_reason for s in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(
                torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4
            )


def test_samples_are_seeded_and_report_sampling_logprobs() -> None:
    model = TinyCausalLM().train()
    prompt = TOK.encode("hi", add_bos=True)
    a = draw(model, prompt, 12, seed=7, num_samples=3)
    assert model.training
    assert a == draw(model, prompt, 12, seed=7, num_samples=3)
    assert a != draw(model, prompt, 12, seed=8, num_samples=3)
    assert len({tuple(s.tokens) for s in a}) == 3

    for temperature in (1.0, 0.5):
        out = draw(model, prompt, 12, temperature=temperature, seed=1)[0]
        assert out.stop_reason == "length" and len(out.tokens) == len(out.logprobs) == 12
        seq = torch.tensor(prompt + out.tokens)
        logits = model(seq[None, :-1])[0, len(prompt) - 1 :] / temperature
        expected = logits.log_softmax(-1).gather(-1, seq[len(prompt) :, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=1e-5)

    greedy = draw(model, prompt, 6, temperature=0)[0]
    assert draw(model, prompt, 6, top_k=1, seed=3)[0].tokens == greedy.tokens
    nucleus = draw(model, prompt, 6, top_p=1e-6, seed=3)[0]
    assert nucleus.tokens == greedy.tokens and nucleus.logprobs == [0.0] * 6  # one token left: p = 1


def test_each_sampled_token_brings_the_top_k_of_the_models_own_distribution() -> None:
    """``topk_logprobs``: per token, the k most likely tokens of the step it was drawn at, at temperature 1 (not
    the temperature sampled at), most likely first: greedy, the token and its log-prob are the first of them."""
    model = TinyCausalLM()
    prompt = TOK.encode("hi", add_bos=True)
    for temperature in (0.0, 0.5):
        out = draw(model, prompt, 8, frozenset(), temperature=temperature, seed=2, topk_logprobs=4)[0]
        assert out.topk is not None and out.topk.k == 4 and len(out.topk.rows) == len(out.tokens) == 8
        seq = torch.tensor(prompt + out.tokens)
        own = model(seq[None, :-1])[0, len(prompt) - 1 :].log_softmax(-1)  # temperature 1
        values, ids = own.topk(4)
        assert [row[0] for row in out.topk.rows if row is not None] == ids.tolist()
        torch.testing.assert_close(torch.tensor([row[1] for row in out.topk.rows if row]), values)
        if temperature == 0:
            assert out.tokens == ids[:, 0].tolist()
            torch.testing.assert_close(torch.tensor(out.logprobs), values[:, 0])
    assert draw(model, prompt, 3)[0].topk is None  # not asked
    with pytest.raises(ValueError, match=r"topk_sample_logprobs must lie in \[0, 258\]"):
        draw(model, prompt, 3, topk_logprobs=TOK.vocab_size + 1)


def test_samples_stop_at_tokens_strings_and_limits() -> None:
    model = TinyCausalLM()
    prompt = TOK.encode("hi", add_bos=True)
    free = draw(model, prompt, 20, seed=5)[0]
    assert free.stop_reason == "length" and len(free.tokens) == 20
    # stop at the first token not seen before it: the same seed draws the same tokens up to there
    i = next(i for i in range(1, 20) if free.tokens[i] not in free.tokens[:i])
    stopped = draw(model, prompt, 20, frozenset({free.tokens[i]}), seed=5)[0]
    assert stopped.tokens == free.tokens[: i + 1] and stopped.stop_reason == "stop"
    assert stopped.logprobs == free.logprobs[: i + 1]

    # a stop string ends each sample at the token that completes it in the decoded text, that token kept; a
    # sample whose text never holds it runs to max_tokens, unchanged by the others' stopping
    samples = draw(model, prompt, 20, frozenset(), seed=5, num_samples=4)
    text = TOK.decode(samples[0].tokens[2:4])
    check = stop_strings([text, "\x00never"], TOK.decode)
    ended = draw(model, prompt, 20, frozenset(), seed=5, num_samples=4, stop_text=check)
    for free_row, row in zip(samples, ended, strict=True):
        end = next((i for i in range(1, 21) if text in TOK.decode(free_row.tokens[:i])), None)
        assert row.tokens == free_row.tokens[:end]  # the batch shrank as samples stopped: float noise only
        torch.testing.assert_close(torch.tensor(row.logprobs), torch.tensor(free_row.logprobs[:end]))
        assert row.stop_reason == ("length" if end is None else "stop")
    assert ended[0].stop_reason == "stop" and len(ended[0].tokens) <= 4
    assert stop_strings([], TOK.decode) is None

    limit = model.config.max_seq_len
    assert len(draw(model, [0] * (limit - 4), 4)[0].tokens) <= 4
    with pytest.raises(ValueError, match="max_seq_len"):
        draw(model, [0] * (limit - 4), 5)
    with pytest.raises(ValueError, match="empty"):
        draw(model, [], 5)
    with pytest.raises(ValueError, match="token ids"):
        draw(model, [TOK.vocab_size], 5)


def _adapted(base: TinyCausalLM, seed: int) -> tuple[TinyCausalLM, lora.Adapter]:
    model = copy.deepcopy(base)
    tiny_lm.add_lora(model, rank=4, seed=seed)
    with torch.no_grad():
        for layer in lora.adapter(model).values():
            layer.lora_b.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model, lora.adapter(model)


def test_requests_joining_a_running_batch_get_what_they_get_alone() -> None:
    """Prompts of several lengths (left padding), read in chunks, of two adapters and the base, submitted while
    others decode and stopping at different times: each request's samples are those it draws alone."""
    base = TinyCausalLM()
    serving = copy.deepcopy(base)
    lora.wrap(serving, tiny_lm.lora_targets(serving, True, True, True), 0, allow_rank_zero=True)
    first, second = _adapted(base, 1), _adapted(base, 2)
    asks = [  # (model alone, adapter, prompt, params)
        (base, None, TOK.encode("hello there", add_bos=True), Params(24, 3, seed=1, stop_tokens=EOS)),
        (
            first[0],
            first[1],
            TOK.encode("a", add_bos=True),
            Params(9, 2, seed=2, stop_tokens=frozenset({101})),
        ),
        (
            second[0],
            second[1],
            TOK.encode("a much longer prompt, read in chunks", add_bos=True),
            Params(30, 2, temperature=0.7, top_k=20, seed=3),
        ),
        (first[0], first[1], TOK.encode("xyz", add_bos=True), Params(5, 1, temperature=0)),
    ]
    alone = [sample(model, prompt, params) for model, _, prompt, params in asks]

    engine = Engine(serving, kv_tokens=10_000, prefill_chunk=7)
    futures = [engine.submit(*asks[0][2:3], asks[0][3], asks[0][1])]
    for _ in range(3):
        engine.step()  # the first request decodes alone for a while
    futures += [engine.submit(prompt, params, adapter) for _, adapter, prompt, params in asks[1:3]]
    engine.step()
    futures.append(engine.submit(asks[3][2], asks[3][3], asks[3][1]))
    engine.drain()
    _as_alone(futures, alone)
    assert engine.rows.kv is None and not engine.rows.requests  # every row left


def test_the_key_value_budget_makes_requests_wait_and_refuses_what_never_fits() -> None:
    model = TinyCausalLM()
    engine = Engine(model, kv_tokens=2 * (4 + 20), prefill_chunk=64)
    prompt = TOK.encode("abc", add_bos=True)  # 4 tokens
    futures = [engine.submit(prompt, Params(20, 1, seed=s, stop_tokens=frozenset())) for s in range(3)]
    engine.step()
    # two rows of 24 positions fill the budget
    assert len(engine.rows.requests) == 2 and len(engine.waiting) == 1
    engine.drain()
    assert all(len(f.result()[0].tokens) == 20 for f in futures)
    with pytest.raises(ValueError, match="more than kv_tokens"):
        engine.submit(prompt, Params(20, 3))


def test_a_late_request_fails_alone_and_closing_fails_the_rest() -> None:
    model = TinyCausalLM()
    engine = Engine(model, kv_tokens=10_000, prefill_chunk=64)
    prompt = TOK.encode("abc", add_bos=True)
    late = engine.submit(prompt, Params(50, 2, stop_tokens=frozenset()), deadline=time.monotonic() + 3600)
    on_time = engine.submit(prompt, Params(10, 1, seed=4, stop_tokens=frozenset()))
    engine.step()
    engine.rows.requests[0].deadline = time.monotonic() - 1  # its time ran out between two steps
    engine.drain()
    with pytest.raises(TimeoutError):
        late.result()
    got, alone = on_time.result()[0], draw(model, prompt, 10, frozenset(), seed=4)[0]
    assert got.tokens == alone.tokens and got.stop_reason == alone.stop_reason == "length"

    engine.start()
    pending = engine.submit(prompt, Params(400, 1, stop_tokens=frozenset()))
    engine.close()
    with pytest.raises(Stopped):
        pending.result(timeout=10)
    with pytest.raises(Stopped):
        engine.submit(prompt, Params(4))


def test_a_newcomer_takes_an_over_served_tenants_room_and_the_preempted_request_still_gets_its_samples() -> (
    None
):
    model = TinyCausalLM()
    prompt, other = TOK.encode("abc", add_bos=True), TOK.encode("xyz", add_bos=True)
    engine = Engine(model, kv_tokens=4 * (4 + 30), prefill_chunk=64)  # two flooding requests of two samples
    flood = [
        engine.submit(prompt, Params(30, 2, seed=s, stop_tokens=frozenset()), tenant="flood")
        for s in range(4)
    ]
    for _ in range(5):
        engine.step()
    assert [r.tenant for r in engine.rows.requests] == ["flood", "flood"]  # the budget is full
    newcomer = engine.submit(other, Params(6, 1, seed=9, stop_tokens=frozenset()), tenant="new")
    steps = 0
    while not newcomer.done():
        engine.step()
        steps += 1
    assert steps <= 7  # joined the next batch (its prompt read, then 6 tokens), not after the flood's 30
    assert engine.preempted == 1 and not any(f.done() for f in flood)
    assert newcomer.result()[0].tokens == draw(model, other, 6, frozenset(), seed=9)[0].tokens
    engine.drain()
    for s, future in enumerate(flood):  # the preempted one started over: the same seeded samples
        assert [x.tokens for x in future.result()] == [
            x.tokens for x in draw(model, prompt, 30, frozenset(), seed=s, num_samples=2)
        ]


def test_one_tenant_is_never_preempted_and_a_cancelled_tenant_leaves_at_the_next_step() -> None:
    model = TinyCausalLM()
    prompt = TOK.encode("abc", add_bos=True)
    engine = Engine(model, kv_tokens=2 * (4 + 30), prefill_chunk=64)
    mine = [engine.submit(prompt, Params(30, 1, stop_tokens=frozenset()), tenant="a") for _ in range(3)]
    theirs = engine.submit(prompt, Params(30, 1, seed=1, stop_tokens=frozenset()), tenant="b")
    engine.step()
    engine.step()
    assert engine.preempted == 0  # "b" waits: "a" holds no more rows than "b" would
    engine.cancel("a")
    engine.step()
    for future in mine:
        with pytest.raises(Cancelled):
            future.result(timeout=0)
    assert not engine.waiting and all(r.tenant == "b" for r in [*engine.reading, *engine.rows.requests])
    engine.drain()
    assert theirs.result()[0].tokens == draw(model, prompt, 30, frozenset(), seed=1)[0].tokens


def test_requests_of_one_prompt_and_adapter_read_it_once_and_each_draws_its_own_samples() -> None:
    """A group's samples sent one request each (the Tinker Cookbook's RL loop does): the prompt is read once for
    the requests of the same adapter that wait together, and each request still gets what it gets alone."""
    base = TinyCausalLM()
    serving = copy.deepcopy(base)
    lora.wrap(serving, tiny_lm.lora_targets(serving, True, True, True), 0, allow_rank_zero=True)
    first = _adapted(base, 1)
    prompt, other = TOK.encode("what is 2 + 3?", add_bos=True), TOK.encode("and 4 + 4?", add_bos=True)
    asks = [(base, None, prompt, Params(12, 1, seed=s, stop_tokens=EOS)) for s in range(5)]
    # the adapter's layers gathered again for each request, as the Tinker API's sampling process does
    asks += [(first[0], lora.adapter(first[0]), prompt, Params(12, 2, seed=s)) for s in (9, 10)]
    asks.append((base, None, other, Params(6, 1, seed=1)))
    alone = [sample(model, p, params) for model, _, p, params in asks]

    engine = Engine(serving, kv_tokens=10_000, prefill_chunk=256)
    reads: list[int] = []
    step = serving.step

    def counted(tokens: torch.Tensor, *args: object) -> object:
        if tokens.shape[1] > 1:  # a prompt's pass; a decoding step is one token a row
            reads.append(tokens.shape[1])
        return step(tokens, *args)

    serving.step = counted  # type: ignore[method-assign]
    futures = [engine.submit(p, params, adapter) for _, adapter, p, params in asks]
    engine.drain()
    # the base's five requests of one prompt: one pass; the adapter's two: one of their own; the other prompt: one
    assert sorted(reads) == sorted([len(prompt), len(prompt), len(other)])
    _as_alone(futures, alone)
    assert engine.rows.kv is None and not engine.rows.requests


def test_prompts_of_one_length_are_read_in_one_pass_and_a_twin_sent_meanwhile_reads_none() -> None:
    """A group of prompts that arrive together (the Cookbook's batch) is read as one pass of several rows, each
    of its own adapter; a request of one of them sent while that pass runs reads nothing; each request gets what
    it gets alone."""
    base = TinyCausalLM()
    serving = copy.deepcopy(base)
    lora.wrap(serving, tiny_lm.lora_targets(serving, True, True, True), 0, allow_rank_zero=True)
    first, second = _adapted(base, 1), _adapted(base, 2)
    prompts = [TOK.encode(f"what is {n} + 3?", add_bos=True) for n in range(3)]  # one length
    asks = [
        (base, None, prompts[0], Params(10, 1, seed=1, stop_tokens=EOS)),
        (first[0], first[1], prompts[1], Params(10, 2, seed=2, stop_tokens=EOS)),
        (second[0], second[1], prompts[2], Params(10, 1, seed=3, stop_tokens=EOS)),
        (base, None, prompts[0], Params(10, 1, seed=4, stop_tokens=EOS)),  # the first one's twin
    ]
    alone = [sample(model, p, params) for model, _, p, params in asks]
    engine = Engine(serving, kv_tokens=10_000, prefill_chunk=256)
    passes: list[tuple[int, ...]] = []
    futures = [engine.submit(p, params, adapter) for _, adapter, p, params in asks[:3]]
    step = serving.step

    def counted(tokens: torch.Tensor, *args: object) -> object:
        if tokens.shape[1] > 1:
            passes.append(tuple(tokens.shape))
            if len(passes) == 1:  # a client's request arriving while the prompts are read
                futures.append(engine.submit(asks[3][2], asks[3][3], asks[3][1]))
        return step(tokens, *args)

    serving.step = counted  # type: ignore[method-assign]
    engine.step()
    assert len(engine.rows.requests) == 4
    engine.drain()
    assert passes == [(3, len(prompts[0]))]
    _as_alone(futures, alone)


def test_an_engine_is_busy_while_a_request_moves_from_reading_its_prompt_to_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose prompt is read leaves the readers before it joins the decoding rows; an engine retired by a
    weight update is closed once it is not busy, and would fail the request in between (the inference endpoint's
    concurrent requests came back ``Stopped`` under load)."""
    engine = Engine(TinyCausalLM(), kv_tokens=10_000, prefill_chunk=64)
    seen: list[bool] = []
    first = Request.first

    def first_token(request: Request, logits: torch.Tensor) -> list:
        seen.append(engine.busy())  # asked by another thread in the endpoint, at this moment
        return first(request, logits)

    monkeypatch.setattr(Request, "first", first_token)
    future = engine.submit(TOK.encode("abc", add_bos=True), Params(5, 2, stop_tokens=frozenset()))
    engine.drain()
    assert seen == [True] and len(future.result()) == 2
    assert not engine.busy()  # answered
