"""The tiny byte-level LM: tokenizer, seeded init, learning, LoRA, and the token-level API functions."""

from __future__ import annotations

import pytest
import torch

from tinker_atropos.models.lora import LoRALinear
from tinker_atropos.models.tiny_lm import (
    ByteTokenizer,
    TinyCausalLM,
    TinyLMConfig,
    add_lora,
    next_token_logprobs,
    target_logprobs,
)
from tinker_atropos.sampling import engine
from tinker_atropos.sampling.params import Params, Topk
from tinker_atropos.tinker_api.engine.sampling_process import prompt_scores
from tinker_atropos.tinker_api.wire import WireError

TOK = ByteTokenizer()
TEXT = "tinker-atropos learns to speak.\n"
IDS = torch.tensor(TOK.encode(TEXT, add_bos=True) + [TOK.eos_id])  # bos, the bytes, eos


def nll(model: TinyCausalLM) -> torch.Tensor:
    return -target_logprobs(model, IDS[:-1], IDS[1:]).mean()


def train(model: TinyCausalLM, params: list[torch.nn.Parameter], steps: int) -> float:
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        loss = nll(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return nll(model).item()


def test_tokenizer_round_trips_utf8_and_skips_specials() -> None:
    text = "héllo, wörld — 世界 🙂"
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert TOK.encode(text, add_bos=True) == [TOK.bos_id, *ids]
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id]) == text
    assert TOK.decode(ids[:-1]).endswith("\ufffd")  # cut mid-character: replaced, not an error
    assert TOK.vocab_size == TinyLMConfig().vocab_size == 258


def test_init_is_a_function_of_the_seed_and_leaves_global_rng_alone() -> None:
    rng = torch.get_rng_state()
    a, b, c = (TinyCausalLM(TinyLMConfig(seed=s)) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and pa.ndim == 2:
            assert not torch.equal(pa, pc), name


def test_forward_shape_and_limits() -> None:
    model = TinyCausalLM(TinyLMConfig(max_seq_len=16))
    assert model(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 258)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[258]]))


def test_learns_a_string_then_greedy_sampling_speaks_it() -> None:
    model = TinyCausalLM()
    assert nll(model).item() > 5.0  # about log(258) at init
    assert train(model, list(model.parameters()), steps=100) < 0.05  # reached at ~45 steps for seeds 0-3
    prompt = IDS[:5].tolist()  # bos + "tink"
    out = engine.sample(model, prompt, Params(64, temperature=0, stop_tokens=frozenset({TOK.eos_id})))[0]
    assert TOK.decode(out.tokens) == TEXT[4:]
    assert out.tokens[-1] == TOK.eos_id and out.stop_reason == "stop"


def test_lora_starts_as_identity_trains_only_adapters_and_round_trips() -> None:
    model = TinyCausalLM()
    before = model(IDS[None])
    base = {k: v.clone() for k, v in model.state_dict().items()}
    params = add_lora(model, rank=4, seed=0)
    assert torch.equal(model(IDS[None]), before)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if "lora_" in name}
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    assert len(params) == 2 * (4 * 2 + 1)  # qkv, proj, fc, proj in each of 2 blocks, and lm_head

    initial = nll(model).item()
    assert train(model, params, steps=30) < 0.5 * initial  # ~1.2 from ~5.5
    for name, value in model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base[name.replace(".base", "")]), name

    restored = TinyCausalLM()
    add_lora(restored, rank=4, seed=123)  # a different A init: load_state_dict overwrites it
    restored.load_state_dict(model.state_dict())
    assert torch.equal(restored(IDS[None]), model(IDS[None]))


def test_lora_targets_and_argument_checks() -> None:
    model = TinyCausalLM()
    add_lora(model, rank=2, train_attn=False, train_unembed=False)
    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped == {f"blocks.{i}.mlp.{n}" for i in range(2) for n in ("fc", "proj")}
    with pytest.raises(ValueError, match="already"):
        add_lora(model, rank=2)
    with pytest.raises(ValueError, match="rank"):
        add_lora(TinyCausalLM(), rank=0)
    with pytest.raises(ValueError, match="target"):
        add_lora(TinyCausalLM(), rank=2, train_attn=False, train_mlp=False, train_unembed=False)


def test_target_logprobs_match_log_softmax() -> None:
    model = TinyCausalLM()
    inputs, targets = IDS[:-1], IDS[1:]
    got = target_logprobs(model, inputs, targets)
    manual = model(inputs[None])[0].log_softmax(-1)[torch.arange(len(targets)), targets]
    torch.testing.assert_close(got, manual)
    got.sum().backward()  # differentiable: the losses are built on it
    assert model.lm_head.weight.grad is not None

    with pytest.raises(ValueError):
        target_logprobs(model, IDS[:3], IDS[:4])


def test_a_prompts_log_probs_and_top_k_are_read_from_one_forward_of_shifted_target_logprobs() -> None:
    """``next_token_logprobs`` row t - 1 scores position t, as ``target_logprobs`` does; the sampler's
    ``prompt_scores`` reads the SampleRequest's prompt log-probs and their top-k from it."""
    model = TinyCausalLM()
    scores = next_token_logprobs(model, IDS.tolist())
    assert scores.shape == (len(IDS) - 1, TinyLMConfig.vocab_size)
    picked = scores[torch.arange(len(IDS) - 1), IDS[1:]]
    torch.testing.assert_close(picked, target_logprobs(model, IDS[:-1], IDS[1:]).detach())
    assert next_token_logprobs(model, [TOK.bos_id]).shape == (0, TinyLMConfig.vocab_size)

    request = {"prompt_logprobs": True, "topk_prompt_logprobs": 3}
    logprobs, topk = prompt_scores(model, IDS.tolist(), request)
    assert logprobs is not None and logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs[1:]), picked)
    assert topk is not None and topk.k == 3 and topk.rows[0] is None and len(topk.rows) == len(IDS)
    for row, position in zip(topk.rows[1:], scores, strict=True):
        assert row is not None
        values, ids = position.topk(3)
        assert row[0] == ids.tolist() and row[1] == pytest.approx(values.tolist())

    last = prompt_scores(model, IDS.tolist(), {**request, "prompt_logprobs_last_n": 2})
    assert last[0] == [None] * (len(IDS) - 2) + logprobs[-2:]
    assert last[1] is not None and last[1].rows == [None] * (len(IDS) - 2) + topk.rows[-2:]
    assert prompt_scores(model, IDS.tolist(), {"topk_prompt_logprobs": 0}) == (None, None)
    assert prompt_scores(model, [TOK.bos_id], request) == ([None], Topk(3, [None]))
    with pytest.raises(WireError, match=r"topk_prompt_logprobs must lie in \[0, 258\]"):
        prompt_scores(model, IDS.tolist(), {"topk_prompt_logprobs": 259})
