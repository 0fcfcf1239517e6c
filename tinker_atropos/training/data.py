"""What a datum is, and what it must satisfy before it reaches a served model, in one place: the Tinker worker
checks every request's data here and the Atropos loop every group's, so that a bad datum is the client's error (or
a group skipped and counted) and never an exception inside a forward pass.

A served model says what it reads as a ``Schema``: the range of its tokens and its context, and for each
``loss_fn_inputs`` name its trailing shape (the leading one is the datum's length T), whether it holds integers
(in a range) or finite numbers, and whether it is required; a loss adds the names it needs (``losses.INPUTS``).
How much memory a request's arrays may take is checked where they are read, before they are allocated
(``tinker_api/wire.py``'s ``Budget``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class ClientError(ValueError):
    """What a client asked of a served model that cannot be done (data it cannot read, a loss it does not compute,
    a LoRA without a target): the client's error, answered as such, never the trainer's."""


class DatumError(ClientError):
    """A datum the model cannot read."""


@dataclass
class Datum:
    """One Tinker ``types.Datum``: its tokens and its ``loss_fn_inputs`` as dense arrays, and, once its provenance
    was looked up (``stable_reinforce``), the log-probs the sampler recorded for its sampled targets."""

    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    sampler_logprobs: np.ndarray | None = None  # float32 [T], NaN where the target was not sampled


@dataclass(frozen=True)
class Input:
    """One ``loss_fn_inputs`` entry a model reads: shape [T, *trailing]; integers in [low, high) or finite numbers."""

    trailing: tuple[int, ...] = ()
    integers: tuple[int, int] | None = None
    required: bool = False


@dataclass(frozen=True)
class Schema:
    inputs: dict[str, Input]
    vocab_size: int | None = None  # model_input tokens lie in [0, vocab_size); None: they are not read
    context: int | None = None  # the most tokens one datum may hold


def check_data(schema: Schema, data: list[Datum], needed: tuple[str, ...]) -> None:
    """DatumError unless every datum fits ``schema`` and has the inputs the loss ``needed``."""
    if not data:
        raise DatumError("forward_backward with no data")
    for index, datum in enumerate(data):
        check_datum(schema, datum, index, needed)


def check_datum(schema: Schema, datum: Datum, index: int, needed: tuple[str, ...] = ()) -> None:
    """DatumError naming the datum and the input, unless ``datum`` fits ``schema`` (and has the ``needed`` inputs)."""
    where, length = f"datum {index}", len(datum.tokens)
    if length == 0:
        raise DatumError(f"{where}: empty model_input")
    if schema.context is not None and length > schema.context:
        raise DatumError(f"{where}: {length} tokens; the model's context is {schema.context}")
    if schema.vocab_size is not None:
        _within(f"{where}: model_input", datum.tokens, 0, schema.vocab_size)
    unknown = sorted(set(datum.inputs) - set(schema.inputs))
    if unknown:
        raise DatumError(
            f"{where}: loss_fn_inputs {unknown} are not read by this model; it reads {sorted(schema.inputs)}"
        )
    for name, spec in schema.inputs.items():
        value, what = datum.inputs.get(name), f"{where}: loss_fn_inputs[{name!r}]"
        if value is None:
            if spec.required or name in needed:
                raise DatumError(
                    f"{what} is required ({'by this model' if spec.required else 'by the loss'})"
                )
            continue
        expected = (length, *spec.trailing)
        if tuple(value.shape) != expected:
            raise DatumError(
                f"{what} has shape {list(value.shape)}; this model takes {list(expected)} (T = the "
                f"model_input length {length})"
            )
        if spec.integers is not None:
            if value.dtype.kind not in "iu":
                raise DatumError(f"{what} must hold integers (int64 or int32), not {value.dtype}")
            _within(what, value, *spec.integers)
        elif not np.isfinite(value).all():
            raise DatumError(f"{what} holds NaN or infinite values")


def _within(what: str, values: np.ndarray, low: int, high: int) -> None:
    if values.size and (int(values.min()) < low or int(values.max()) >= high):
        raise DatumError(
            f"{what} must lie in [{low}, {high}); it holds {int(values.min())} to {int(values.max())}"
        )
