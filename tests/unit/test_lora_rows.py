"""Several adapters of one base in one pass (``lora.rows``): each row's output and gradients are those of its own
model run alone, rows of the base itself get no update, and a tree without adapters of its own serves them all."""

from __future__ import annotations

import copy

import pytest
import torch

from tinker_atropos.models import lora, tiny_lm
from tinker_atropos.models.tiny_lm import TinyCausalLM

TOKENS = torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(0))


def _adapted(base: TinyCausalLM, seed: int, **targets: bool) -> TinyCausalLM:
    """A LoRA model of ``base`` whose B is not zero (a fresh adapter changes nothing, which would prove nothing)."""
    model = copy.deepcopy(base)
    tiny_lm.add_lora(model, rank=4, seed=seed, **targets)
    with torch.no_grad():
        for layer in lora.adapter(model).values():
            layer.lora_b.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


def test_a_batch_of_several_adapters_is_each_model_alone_outputs_and_gradients() -> None:
    base = TinyCausalLM()
    first, second = _adapted(base, 1), _adapted(base, 2, train_mlp=False)
    alone = [first(TOKENS[:2]), second(TOKENS[2:4]), base(TOKENS[4:])]
    assert not torch.allclose(alone[0], base(TOKENS[:2]), atol=1e-3)  # the adapters do change the outputs

    (alone[0].square().mean() + alone[1].square().mean()).backward()
    grads = {id(p): p.grad.clone() for m in (first, second) for p in m.parameters() if p.requires_grad}
    for m in (first, second):
        m.zero_grad()

    with lora.rows([(2, lora.adapter(first)), (2, lora.adapter(second)), (1, None)]):
        batched = first(TOKENS)  # any tree of the base runs them: here the first model's
    for got, want in zip(torch.split(batched, [2, 2, 1]), alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    (batched[:2].square().mean() + batched[2:4].square().mean()).backward()
    for m in (first, second):
        for p in m.parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, grads[id(p)], atol=1e-6, rtol=1e-4)
    assert all(p.grad is None for m in (first, second) for p in m.parameters() if not p.requires_grad)


def test_a_tree_without_adapters_of_its_own_serves_other_models_rows() -> None:
    base = TinyCausalLM()
    model = _adapted(base, 3)
    serving = copy.deepcopy(base)
    params = lora.wrap(serving, tiny_lm.lora_targets(serving, True, True, True), 0, allow_rank_zero=True)
    assert params == [] and not any(p.requires_grad for p in serving.parameters())
    torch.testing.assert_close(serving(TOKENS), base(TOKENS))  # outside rows(): the base alone
    with torch.inference_mode(), lora.rows([(3, None), (2, lora.adapter(model))]):
        got = serving(TOKENS)
    torch.testing.assert_close(got[:3], base(TOKENS[:3]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3:], model(TOKENS[3:]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rank"):
        lora.wrap(copy.deepcopy(base), tiny_lm.lora_targets(base, True, True, True), 0)


def test_neighbouring_rows_of_one_adapter_take_one_update_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's one-sample requests in a batch (the Cookbook's RL loop sends a group so) are one segment each:
    their rows share a low-rank matmul per layer, with the outputs of each segment alone."""
    base = TinyCausalLM()
    first, second = _adapted(base, 1), _adapted(base, 2)
    calls: list[int] = []
    update = lora.LoRALinear.update
    monkeypatch.setattr(lora.LoRALinear, "update", lambda self, x: calls.append(len(x)) or update(self, x))
    layers = len(lora.adapter(first))
    segments = [(1, lora.adapter(first)), (1, lora.adapter(first)), (1, lora.adapter(second)), (2, None)]
    with (
        torch.no_grad(),
        lora.rows(segments),
    ):  # lora.adapter builds a new mapping each time: equal, not the same
        batched = first(TOKENS)
    assert calls == [2, 1] * layers  # rows of the first model together, then the second's
    with torch.no_grad():
        torch.testing.assert_close(batched[:2], first(TOKENS[:2]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched[2:3], second(TOKENS[2:3]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched[3:], base(TOKENS[3:]), atol=1e-5, rtol=1e-5)
