"""The non-finite guard's own copy of a core's state (``TrainingCore.snapshot``): an undone step leaves the
parameters, the optimizer's moments and the version exactly as they were, a first step's moments gone too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinker_atropos.training import core as training_core
from tinker_atropos.training.core import AdamParams, TrainingCore
from tinker_atropos.training.guard import NonfiniteGuard


def core() -> TrainingCore:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)  # frozen, as a LoRA model's base
    return TrainingCore(model, {}, torch.device("cpu"))


def gradients(c: TrainingCore, poison: bool = False) -> None:
    x = torch.randn(8, 3)
    loss = c.model(x).pow(2).mean() * (float("nan") if poison else 1.0)
    c.forward_backward(lambda _: (loss, {}))


def state(c: TrainingCore) -> dict:
    return {
        "params": [p.detach().clone() for p in c.model.parameters()],
        "version": c.version,
        "moments": {
            i: {k: v.clone() for k, v in c.optimizer.state[p].items()}
            for i, p in enumerate(c.model.parameters())
            if p in c.optimizer.state
        },
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["version"] == b["version"] and a["moments"].keys() == b["moments"].keys()
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    for i, moments in a["moments"].items():
        assert moments.keys() == b["moments"][i].keys()
        assert all(torch.equal(v, b["moments"][i][k]) for k, v in moments.items())


@pytest.mark.parametrize("kept", [True, False], ids=["copies-kept", "copies-each-step"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_an_undone_step_restores_parameters_moments_and_version_exactly(
    steps_before: int, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kept:  # a model too large for its copies to be kept between steps
        monkeypatch.setattr(training_core, "KEEP_SHADOW_BYTES", 0)
    c, guard, adam = core(), NonfiniteGuard(), AdamParams(learning_rate=1e-2)
    for _ in range(steps_before):
        gradients(c)
        _, bad = guard.update(c, None, lambda: c.optim_step(adam))
        c.version += 1
        assert not bad
    before = state(c)
    assert bool(before["moments"]) == (steps_before > 0)
    gradients(c, poison=True)

    def poisoned_step() -> dict[str, float]:
        c.version += 1  # what the step changes of the core besides the tensors is undone as well
        return c.optim_step(adam)

    _, bad = guard.update(c, None, poisoned_step)
    assert bad and guard.undone == 1 and guard.in_a_row == 1
    assert_same(state(c), before)
    assert all(p.grad is None for p in c.model.parameters())
    gradients(c)  # and it learns on from there
    _, bad = guard.update(c, None, lambda: c.optim_step(adam))
    assert not bad and guard.in_a_row == 0


def test_nonfinite_names_the_trained_tensors_and_buffers_that_hold_nan_or_inf_and_nothing_frozen() -> None:
    c = core()
    c.model.register_buffer("running", torch.zeros(3))
    assert c.nonfinite() == []
    with torch.no_grad():
        c.model[2].bias.fill_(float("-inf"))
        c.model[0].weight.fill_(float("nan"))  # frozen: it cannot have changed, it is not looked at
    c.model.running[1] = float("nan")
    assert c.nonfinite() == ["2.bias", "running"]
    assert torch.isneginf(c.model[2].bias).all()  # looked at, not changed


def test_a_step_that_stands_is_the_next_version_and_one_undone_is_not() -> None:
    """The one version rule, in the core and applied by the guard every driver steps through."""
    c, guard = core(), NonfiniteGuard()
    gradients(c)
    guard.update(c, None, lambda: c.optim_step(AdamParams(learning_rate=1e-2)))
    assert c.version == 1
    gradients(c, poison=True)
    _, bad = guard.update(c, None, lambda: c.optim_step(AdamParams(learning_rate=1e-2)))
    assert bad and c.version == 1


def test_a_core_goes_on_above_a_version_seen_elsewhere_and_never_back() -> None:
    c = core()
    c.continue_above(6)  # a rollout acts with 6: the next is 7
    assert c.version == 7
    c.continue_above(9, adopt=True)  # the weights of 9 loaded: it is 9
    assert c.version == 9
    c.continue_above(3)
    c.continue_above(4, adopt=True)
    assert c.version == 9
