"""Requests of several LoRA models of one base run as one batched pass (``run_losses``). Each
model's outputs, loss and gradients are those of its own ``run_loss`` within float rounding, and so is each model
after its optimizer step; a request the model cannot take fails alone, its group-mates unharmed; a forward-only
request in the group gets its outputs and no gradient; one adapter's step changes no other model's outputs."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.support.hf_models import model_folder
from tinker_atropos.tinker_api.engine.dispatch import together
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.data import ClientError, Datum
from tinker_atropos.training.served import (
    LANGUAGE_MODELS,
    TINY_LM,
    LanguageModel,
    LossRun,
    register_folder,
    run_loss,
    run_losses,
)

CPU = torch.device("cpu")
ADAM = AdamParams(learning_rate=1e-2)
# (rank, seed) of each model of a group: ranks may differ within one
MODELS = [(4, 1), (8, 2), (8, 3)]


@pytest.fixture(params=[TINY_LM, "llama"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny LM, or a small random Llama served from its folder."""
    if request.param == TINY_LM:
        yield TINY_LM
        return
    name = "test/grouped-llama"
    register_folder(name, str(model_folder(tmp_path_factory.mktemp("llama"), "llama")), torch.float32)
    yield name
    LANGUAGE_MODELS.pop(name)


def lm(base: str, rank: int, seed: int) -> LanguageModel:
    """A LoRA model whose B is not zero (a fresh adapter changes nothing, which would prove nothing)."""
    model = LanguageModel(base, {"rank": rank, "seed": seed}, CPU)
    with torch.no_grad():
        for layer in model.adapter.values():
            layer.lora_b.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


def data(seed: int, lengths: list[int]) -> list[Datum]:
    """Next-token data of the given lengths (each model's data differ, and so do their lengths)."""
    rng = np.random.default_rng(seed)
    made = []
    for length in lengths:
        tokens = rng.integers(0, 256, length + 1)
        made.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": rng.random(length)}))
    return made


DATA = [data(1, [5, 9]), data(2, [12]), data(3, [3, 7, 4])]


def grads(model: LanguageModel) -> list[torch.Tensor | None]:
    return [p.grad for p in model.core.model.parameters() if p.requires_grad]


def trained(model: LanguageModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.core.model.parameters() if p.requires_grad]


def logits(model: LanguageModel) -> torch.Tensor:
    with torch.no_grad():
        return model.core.model(torch.tensor([[1, 5, 9, 14, 2, 7]]))


def close(got: object, want: object) -> None:
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_batched_pass_is_each_model_alone_outputs_losses_gradients_and_steps(base: str) -> None:
    alone = [lm(base, rank, seed) for rank, seed in MODELS]
    grouped = [lm(base, rank, seed) for rank, seed in MODELS]
    expected = [
        run_loss(m, d, "cross_entropy", {}, forward_only=False) for m, d in zip(alone, DATA, strict=True)
    ]
    outcomes = run_losses(
        [LossRun(m, d, "cross_entropy", {}, False) for m, d in zip(grouped, DATA, strict=True)]
    )
    for (outputs, metrics), (want_outputs, want_metrics) in zip(outcomes, expected, strict=True):
        for got, want in zip(outputs, want_outputs, strict=True):
            close(torch.from_numpy(got["logprobs"]), torch.from_numpy(want["logprobs"]))
        assert metrics.keys() == want_metrics.keys()
        close(metrics["loss:sum"], want_metrics["loss:sum"])
    for mine, reference in zip(grouped, alone, strict=True):
        assert all(g is not None for g in grads(mine))
        for got, want in zip(grads(mine), grads(reference), strict=True):
            close(got, want)
        mine.core.optim_step(ADAM)
        reference.core.optim_step(ADAM)
        for got, want in zip(trained(mine), trained(reference), strict=True):
            close(got, want)


def test_a_request_that_fails_fails_alone_and_a_forward_only_one_gets_no_gradient(base: str) -> None:
    alone = [lm(base, rank, seed) for rank, seed in MODELS]
    grouped = [lm(base, rank, seed) for rank, seed in MODELS]
    bad = data(4, [6])
    bad[0].tokens[2] = 10**6  # past the vocabulary
    runs = [
        LossRun(grouped[0], DATA[0], "cross_entropy", {}, False),
        LossRun(grouped[1], bad, "cross_entropy", {}, False),
        LossRun(grouped[2], DATA[2], "cross_entropy", {}, True),
    ]
    first, failed, forward = run_losses(runs)
    assert isinstance(failed, ClientError) and "datum 0" in str(failed)
    assert all(g is None for g in grads(grouped[1]) + grads(grouped[2]))
    close(first[1]["loss:sum"], run_loss(alone[0], DATA[0], "cross_entropy", {}, False)[1]["loss:sum"])
    for got, want in zip(grads(grouped[0]), grads(alone[0]), strict=True):
        close(got, want)
    want_outputs, want_metrics = run_loss(alone[2], DATA[2], "cross_entropy", {}, forward_only=True)
    close(forward[1]["loss:sum"], want_metrics["loss:sum"])
    for got, want in zip(forward[0], want_outputs, strict=True):
        close(torch.from_numpy(got["logprobs"]), torch.from_numpy(want["logprobs"]))

    # a loss it cannot compute, and a request past its budget (its check), fail alone too
    def past_budget() -> None:
        raise ClientError("past its time budget")

    for model in grouped:
        model.core.discard_gradients()
    rewarded = [Datum(d.tokens, {**d.inputs, "advantages": np.ones(len(d.tokens))}) for d in DATA[1]]
    outcomes = run_losses(
        [
            LossRun(grouped[0], DATA[0], "cross_entropy", {}, False),
            LossRun(grouped[1], rewarded, "stable_reinforce", {}, False),  # without the sampler's log-probs
            LossRun(grouped[2], DATA[2], "cross_entropy", {}, False, check=past_budget),
        ]
    )
    assert isinstance(outcomes[1], ClientError) and "provenance" in str(outcomes[1])
    assert isinstance(outcomes[2], ClientError)
    assert "past its time budget" in str(outcomes[2])
    assert all(g is None for g in grads(grouped[1]) + grads(grouped[2]))
    for got, want in zip(grads(grouped[0]), grads(alone[0]), strict=True):
        close(got, want)


def test_one_adapters_step_after_a_batched_pass_changes_no_other_models_outputs() -> None:
    models = [lm(TINY_LM, rank, seed) for rank, seed in MODELS]
    run_losses([LossRun(m, d, "cross_entropy", {}, False) for m, d in zip(models, DATA, strict=True)])
    before = [logits(m) for m in models]
    models[0].core.optim_step(ADAM)
    assert not torch.equal(logits(models[0]), before[0])
    for model, was in zip(models[1:], before[1:], strict=True):
        assert torch.equal(logits(model), was)


def test_only_lora_models_of_one_base_and_layout_with_a_forward_backward_next_run_together() -> None:
    models = {
        "a": lm(TINY_LM, 4, 1),
        "b": lm(TINY_LM, 8, 2),  # another rank: the same layout
        "c": lm(TINY_LM, 4, 3),  # its next request is an optim_step
        "full": LanguageModel(TINY_LM, {"rank": 0}, CPU),
        "attention": LanguageModel(TINY_LM, {"rank": 4, "train_mlp": False}, CPU),
        "attention2": LanguageModel(TINY_LM, {"rank": 4, "train_mlp": False, "seed": 5}, CPU),
    }
    jobs = [(name, f"req-{name}", (name, 1)) for name in models] + [("sampler", "req-sample", None)]

    def kinds(request_ids: list[str]) -> list[str | None]:
        return ["optim_step" if request_id == "req-c" else "forward_backward" for request_id in request_ids]

    runs = together(jobs, models, kinds)
    assert sorted(sorted(job[0] for job in run) for run in runs) == [
        ["a", "b"],
        ["attention", "attention2"],
        ["c"],
        ["full"],
        ["sampler"],
    ]
    halves = together(jobs, models, kinds, passes=2)  # a pair split in two: each alone
    assert sorted(sorted(job[0] for job in run) for run in halves) == [
        ["a"],
        ["attention"],
        ["attention2"],
        ["b"],
        ["c"],
        ["full"],
        ["sampler"],
    ]
