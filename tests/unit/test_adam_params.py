"""The Tinker API's ``optim_step`` reads the SDK's AdamParams with the pinned SDK's own defaults for the fields a
client leaves out (``engine.training.adam_params``), never a copy of them that could drift from the SDK's."""

from __future__ import annotations

import dataclasses

import pytest
from tinker import types

from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.training_steps import adam_params
from tinker_atropos.training.core import AdamParams


def test_absent_fields_take_the_sdks_defaults() -> None:
    sdk = types.AdamParams()
    assert adam_params({}) == AdamParams(
        learning_rate=sdk.learning_rate,
        beta1=sdk.beta1,
        beta2=sdk.beta2,
        eps=sdk.eps,
        weight_decay=sdk.weight_decay,
        grad_clip_norm=sdk.grad_clip_norm or None,  # the SDK's 0: no clip
    )
    # every field of the core's settings is one of the SDK's: none is left to a default of ours
    assert {field.name for field in dataclasses.fields(AdamParams)} <= set(types.AdamParams.model_fields)


def test_what_the_sdk_sends_is_read_as_sent() -> None:
    sent = types.AdamParams(learning_rate=3e-3, beta2=0.99, grad_clip_norm=1.5).model_dump()
    assert adam_params(sent) == AdamParams(3e-3, 0.9, 0.99, 1e-12, 0.0, 1.5)


@pytest.mark.parametrize("bad", [{"learning_rate": float("nan")}, {"beta1": 1.0}, {"eps": 0}, None])
def test_values_no_step_can_be_taken_with_are_refused(bad: dict[str, float] | None) -> None:
    with pytest.raises(wire.WireError):
        adam_params(bad)
