"""One base, many adapters. Every LoRA model of a base holds that base's frozen tensors themselves
(one copy per base and device); a fully trained model (rank 0) copies them and trains every one. One model's step,
an undone step, a checkpoint loaded: none writes into the shared base (its tensors' version counters, which every
in-place write bumps, stay where they were) or changes another model's outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinker_atropos.models import smollm2
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.data import ClientError, Datum
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import (
    TINY_LM,
    LanguageModel,
    owned_bytes,
    run_loss,
    shared_base,
    shared_tensors,
)

CPU = torch.device("cpu")
PROMPT = torch.tensor([[1, 5, 9, 14, 2, 7]])


def lm(base: str, rank: int, seed: int = 0) -> LanguageModel:
    return LanguageModel(base, {"rank": rank, "seed": seed}, CPU)


def outputs(model: LanguageModel) -> torch.Tensor:
    with torch.no_grad():
        return model.core.model(PROMPT)


def step(model: LanguageModel, lr: float = 1e-2) -> None:
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5])
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:]})
    run_loss(model, [datum], "cross_entropy", {}, forward_only=False)
    model.core.optim_step(AdamParams(learning_rate=lr))


def versions(base: str) -> list[int]:
    """The in-place write counters of the shared base's tensors."""
    return [t._version for t in shared_tensors(shared_base(base, CPU))]


def test_lora_models_hold_the_bases_tensors_and_full_ones_copies_trained_whole() -> None:
    first, second = lm(TINY_LM, 4), lm(TINY_LM, 8, seed=1)
    full = lm(TINY_LM, 0)  # after LoRA models: their freezing must not reach its copy
    base = shared_tensors(shared_base(TINY_LM, CPU))
    assert base and not any(t.requires_grad for t in base)
    for model in (first, second):
        held = {id(t) for t in [*model.core.model.parameters(), *model.core.model.buffers()]}
        assert all(id(t) in held for t in base)
        trained = [p for p in model.core.model.parameters() if p.requires_grad]
        assert trained and not any(model.core.is_shared(p) for p in trained)
        assert owned_bytes(model) == 4 * sum(p.nbytes for p in trained)
    pointers = {t.data_ptr() for t in base}
    assert all(p.requires_grad for p in full.core.model.parameters())
    assert not any(p.data_ptr() in pointers for p in full.core.model.parameters())
    assert first.model_state().keys() == {
        n for n, p in first.core.model.named_parameters() if p.requires_grad
    }


@pytest.mark.parametrize("base", [TINY_LM, smollm2.NAME], ids=["tiny-lm", "smollm2"])
def test_one_models_step_changes_no_other_models_outputs_nor_the_base(base: str) -> None:
    if base == smollm2.NAME and not smollm2.available():
        pytest.skip("SmolLM2 is not installed")
    trained, other, full = lm(base, 8), lm(base, 8, seed=1), lm(base, 0)
    step(other)  # B no longer zero: its adapters change its outputs
    before = {"other": outputs(other), "full": outputs(full), "trained": outputs(trained)}
    written = versions(base)
    for _ in range(2):
        step(trained)
    assert not torch.equal(outputs(trained), before["trained"])
    assert torch.equal(outputs(other), before["other"]) and torch.equal(outputs(full), before["full"])
    step(full, lr=1e-3)
    assert not torch.equal(outputs(full), before["full"])
    assert torch.equal(outputs(other), before["other"])
    assert versions(base) == written
    assert torch.equal(outputs(lm(base, 8, seed=1)), outputs(lm(base, 0)))  # a new model: the base as it was


def test_an_undone_step_and_loaded_checkpoints_never_write_the_shared_base() -> None:
    model, guard = lm(TINY_LM, 8), NonfiniteGuard()
    step(model)
    written, before = versions(TINY_LM), outputs(model)
    adapter = next(p for p in model.core.model.parameters() if p.requires_grad)

    def poisoned() -> dict[str, float]:
        with torch.no_grad():
            adapter.fill_(float("nan"))
        return {}

    _, bad = guard.update(model.core, None, poisoned)
    assert bad and torch.equal(outputs(model), before)
    full = lm(TINY_LM, 0)
    step(full, lr=1e-1)
    with pytest.raises(ClientError, match="does not fit"):  # a full model's weights: no adapters in them
        model.load_model_state(full.model_state())
    # adapters beside another base (what the Atropos loop's checkpoints held): the base's part is skipped
    shared = model.core.shared_names()
    stale = {name: v + 1 if name in shared else v for name, v in model.core.model.state_dict().items()}
    model.load_model_state(stale)
    model.core.load_state_dict(model.core.state_dict())
    assert versions(TINY_LM) == written and torch.equal(outputs(model), before)
    assert not any(model.core.is_shared(t) for t in model.core.state_dict()["model"].values())
