"""Target log-probs with shared prefixes (``models.logprobs``): the plan groups the answers to one prompt, and the
log-probs and gradients are each sequence's own forward's, also for several adapters of one base in one batch."""

from __future__ import annotations

import copy

import pytest
import torch

from tinker_atropos.models import lora, tiny_lm
from tinker_atropos.models.logprobs import plan, target_logprobs
from tinker_atropos.models.tiny_lm import TinyCausalLM

GEN = torch.Generator().manual_seed(0)


def _groups(prompts: int, answers: int, prompt_len: int = 20) -> list[torch.Tensor]:
    """``prompts`` prompts of ``answers`` answers each, 1 to 8 tokens, each answer's first token its own."""
    sequences = []
    for p in range(prompts):
        prompt = torch.randint(0, 256, (prompt_len + p,), generator=GEN)
        for a in range(answers):
            rest = torch.randint(0, 256, (int(torch.randint(0, 8, (1,), generator=GEN)),), generator=GEN)
            sequences.append(torch.cat([prompt, torch.tensor([a]), rest]))
    return sequences


def test_the_plan_shares_each_prompt_among_its_answers_and_nothing_across_owners() -> None:
    sequences = [s.tolist() for s in _groups(3, 4)]
    order = torch.randperm(len(sequences), generator=GEN).tolist()
    shuffled = [sequences[i] for i in order]
    groups = plan(shuffled, [0] * len(shuffled))
    assert sorted(g.shared for g in groups) == [20, 21, 22]  # each prompt, forwarded once
    assert sorted(len(g.members) for g in groups) == [4, 4, 4]
    for g in groups:
        assert len({tuple(shuffled[i][: g.shared]) for i in g.members}) == 1
        assert all(len(shuffled[i]) > g.shared for i in g.members)  # each keeps a token of its own
    assert sorted(i for g in groups for i in g.members) == list(range(len(shuffled)))

    # the same prompt under two owners (two adapters' models): two groups, their keys and values differ
    twice = sequences[:4] * 2
    assert sorted(len(g.members) for g in plan(twice, [0] * 4 + [1] * 4)) == [4, 4]
    # sequences that share nothing, or a copy of itself: one pass as before, and a copy shares all but its last
    assert [len(g.members) for g in plan([[1, 2, 3], [4, 5], [6]], [0, 0, 0])] == [1, 1, 1]
    assert [(len(g.members), g.shared) for g in plan([[7, 8, 9], [7, 8, 9]], [0, 0])] == [(2, 2)]


def _adapted(base: TinyCausalLM, seed: int) -> TinyCausalLM:
    """A LoRA model of ``base`` whose B is not zero (a fresh adapter changes nothing, which would prove nothing),
    in float64: sharing changes only the order of the sums, so the results agree to float64's rounding."""
    model = copy.deepcopy(base)
    tiny_lm.add_lora(model, rank=4, seed=seed)
    model.double()
    with torch.no_grad():
        for layer in lora.adapter(model).values():
            layer.lora_b.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


def _alone(model: TinyCausalLM, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's log-probs from a forward of its own, no cache: what sharing must give."""
    return [model(s[None, :-1])[0].log_softmax(-1).gather(-1, s[1:, None])[:, 0] for s in sequences]


def _weighted(found: list[torch.Tensor]) -> torch.Tensor:
    """A loss that weighs every position differently, so that each one's gradient counts."""
    return sum((lp * torch.linspace(0.1, 1.0, len(lp))).sum() for lp in found)


def _gradients(models: list[TinyCausalLM], loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("extra", [[], [[5, 6], [9, 9, 9, 9]]], ids=["groups", "groups-and-loners"])
def test_shared_prefix_log_probs_and_gradients_are_each_sequences_own(extra: list[list[int]]) -> None:
    model = _adapted(TinyCausalLM(), 1)
    sequences = _groups(3, 4) + [torch.tensor(s) for s in extra]
    sequences = [sequences[i] for i in torch.randperm(len(sequences), generator=GEN).tolist()]
    want = _alone(model, sequences)
    got = target_logprobs(model, [s[:-1] for s in sequences], [s[1:] for s in sequences])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    for g, w in zip(_gradients([model], _weighted(got)), _gradients([model], _weighted(want)), strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


def test_several_adapters_share_their_own_prefixes_in_one_batch() -> None:
    base = TinyCausalLM()
    first, second = _adapted(base, 1), _adapted(base, 2)
    ones, twos = _groups(2, 3), _groups(2, 3)[:3] + _groups(1, 2)  # the first model's prompts, and new ones
    ones_want, twos_want = _alone(first, ones), _alone(second, twos)
    both = ones + twos
    adapters = [lora.adapter(first)] * len(ones) + [lora.adapter(second)] * len(twos)
    got = target_logprobs(first, [s[:-1] for s in both], [s[1:] for s in both], adapters)
    for g, w in zip(got, ones_want + twos_want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    want = _gradients([first, second], _weighted(ones_want) + 2 * _weighted(twos_want))
    shared = _gradients([first, second], _weighted(got[: len(ones)]) + 2 * _weighted(got[len(ones) :]))
    for g, w in zip(shared, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


def test_mismatched_inputs_and_targets_are_refused() -> None:
    model = TinyCausalLM()
    ids = torch.arange(6)
    with pytest.raises(ValueError, match="as many targets"):
        target_logprobs(model, [ids[:3]], [ids[:4]])
    with pytest.raises(ValueError, match="at least one"):
        target_logprobs(model, [], [])
