"""A scored group read with its rows of numbers compact (``frontends/atropos/rows.py``): whatever a body spells, the
API answers as when every number was a Python object (the same 422 errors, the same values stored), while a large
body's rows build nothing per number, and what is read as Python objects is bounded."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tinker_atropos.frontends.atropos import rows
from tinker_atropos.frontends.atropos.app import GROUPS, ONE_GROUP, ScoredData, lined_up
from tinker_atropos.frontends.atropos.rows import CompactRows, GroupReader, encode
from tinker_atropos.frontends.bodies import BodyError, scan

FIELDS = tuple(ScoredData.model_fields)
# how a number may be spelled: ids, masks, floats, and what pydantic reads otherwise or refuses (a mask's -0, a
# float past its range, an integer where a float is, a string, a NaN, which JSON has not)
SPELLINGS = [
    "0",
    "7",
    "1000",
    "999999999",
    "1000000000",
    "2147483648",
    "-1",
    "-0",
    "-100",
    "1.0",
    "1.5",
    "1e3",
    "1E-05",
    "-1.5e+10",
    "1e308",
    "1e309",
    "-0.0",
    "0.1000000000000000055511151231257827",
    "NaN",
    "123456789012345678901234567890",
    "12345678901234567890.5",
    '"5"',
    '"x"',
    "null",
    "[1]",
    "{}",
]
SEPARATORS = [",", ", ", " ,\n"]


def _row(draw: Any, length: int) -> str:
    separator = draw(st.sampled_from(SEPARATORS))
    return (
        "["
        + separator.join(draw(st.lists(st.sampled_from(SPELLINGS), min_size=length, max_size=length)))
        + "]"
    )


@st.composite
def groups(draw: Any) -> bytes:
    """A group's JSON whose row fields hold any of ``SPELLINGS``, lined up or not."""
    lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    fields = {"tokens": lengths, "masks": lengths, "scores": None}
    for name in ("inference_logprobs", "advantages", "ref_logprobs"):
        if draw(st.booleans()):
            fields[name] = lengths
    if draw(st.booleans()):
        fields["masks"] = [*lengths[:-1], lengths[-1] + 1]
    body = {
        name: "[" + ",".join(_row(draw, n) for n in rows_of) + "]"
        if rows_of
        else json.dumps([0.5] * len(lengths))
        for name, rows_of in fields.items()
    }
    return ("{" + ",".join(f'"{name}":{value}' for name, value in body.items()) + "}").encode()


def _answer(parsed: Any, listed: bool = False) -> tuple[str, Any]:
    """What the API makes of a parsed body: its 422 (lined up, validation errors) or the JSON it stores, read back."""
    try:
        for group in parsed if listed else [parsed]:
            lined_up(group)
        value = (GROUPS if listed else ONE_GROUP).validate_python(parsed)
    except ValueError as error:
        errors = error.errors() if isinstance(error, ValidationError) else str(error)
        return "refused", errors if isinstance(errors, str) else [(e["type"], e["loc"]) for e in errors]
    stored = [encode(dict(group)) for group in (value if listed else [value])]
    return "stored", json.dumps([pydantic_core.from_json(group) for group in stored])  # 1 and 1.0 differ


@settings(max_examples=400, deadline=None)
@given(body=groups())
def test_whatever_a_body_spells_the_answer_is_as_from_python_objects(body: bytes) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rows, "ROWS_BYTES", 1)  # every row field compact where it may be
        read = GroupReader(FIELDS, 1 << 20).read(body, scan(body), listed=False)
    assert _answer(read) == _answer(pydantic_core.from_json(body))


def _sound(sequences: int, length: int) -> dict[str, Any]:
    return {
        "tokens": [[1000 + k] * length for k in range(sequences)],
        "masks": [[-100] * length for _ in range(sequences)],
        "scores": [0.5] * sequences,
        "inference_logprobs": [[-0.25] * length for _ in range(sequences)],
        "env_id": 0,
    }


def test_rows_are_read_compact_and_stored_as_pydantic_writes_them() -> None:
    groups = [_sound(3, 5000), {**_sound(2, 2000), "masks": [[1] * 2000, [0] * 2000]}]
    body = json.dumps(groups).encode()  # ", " between numbers, as atroposlib's environments post them
    read = GroupReader(FIELDS, 1 << 20).read(body, scan(body), listed=True)
    for group, sent in zip(read, groups, strict=True):
        for name in ("tokens", "masks", "inference_logprobs"):
            assert isinstance(group[name], CompactRows), name
            assert group[name].lengths == [len(row) for row in sent[name]]
    stored = [encode(dict(group)) for group in GROUPS.validate_python(read)]
    assert stored == [pydantic_core.to_json(dict(g)) for g in GROUPS.validate_python(groups)]


def test_a_large_bodys_rows_build_nothing_per_number() -> None:
    body = json.dumps({**_sound(4, 500_000), "masks": [[1000] * 500_000] * 3 + [[1000] * 499_999]}).encode()
    reader = GroupReader(FIELDS, 64 << 20)
    tracemalloc.start()
    try:
        parsed = reader.read(body, scan(body), listed=False)
        with pytest.raises(ValueError, match=r"masks\[3\] has 499999 entries for 500000 tokens"):
            lined_up(parsed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the rows without the spaces between their numbers, and little else (as Python lists: over 7 times the body)
    assert peak < 1.5 * len(body), peak / len(body)


@pytest.mark.parametrize(
    ("what", "body"),
    [
        (
            "JSON values",
            '{"tokens":[[1]],"masks":[[1]],"scores":[0],"ref_logprobs":[[' + "0," * 4096 + "0]]}",
        ),
        ("strings", '{"tokens":[[1]],"masks":[[1]],"scores":[0],"images":[' + '"a",' * 2048 + '"a"]}'),
        ("colons", '{"tokens":[[1]],"masks":[[1]],"generation_params":{' + '"a":0,' * 512 + '"b":0}}'),
        ("JSON values", '{"scores":[NaN],"tokens":[[' + "1000," * 4096 + "1]]}"),  # not JSON: read whole
    ],
)
def test_what_would_be_read_as_python_objects_is_bounded_before_it_is_read(what: str, body: str) -> None:
    with pytest.raises(BodyError) as refused:
        GroupReader(FIELDS, 1 << 15).read(body.encode(), scan(body.encode()), listed=False)
    assert refused.value.status == 413 and what in refused.value.detail, refused.value.detail
