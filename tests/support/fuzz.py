"""Bounded, reproducible property tests: Hypothesis settings that try the same inputs every run and write no example
database, and mutations of valid encodings (pure random bytes rarely get past a decoder's first check)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.extra import numpy as hnp

from tinker_atropos.protocol import local_stream

# Hypothesis caches the constants of the source it reads under ./.hypothesis even without an example database,
# from the moment tests are collected: keep it out of the repository.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "tinker-atropos-hypothesis")


def fuzz(examples: int) -> settings:
    """Bounded and reproducible: the same inputs every run, and no .hypothesis folder in the repository."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- mutations of valid encodings: pure random bytes rarely get past the first check ---------------------------
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with one to four edits: a bit flipped, a byte set, bytes inserted, deleted or repeated, a huge
    varint spliced in (a length or a shape field gone wild), or the tail cut off."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "repeat", "varint", "truncate"]))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
        elif op == "varint":  # a length, count or shape entry of up to 2**64 - 1
            data[at : at + draw(st.integers(0, 2))] = draw(
                st.sampled_from([b"\xff" * 9 + b"\x01", b"\x80" * 10, b"\xff\xff\xff\xff\x0f"])
            )
        else:
            del data[at:]
    return bytes(data)


def bytes_like(*valid: bytes) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, the valid encodings themselves, and mutations of them."""
    return st.binary(max_size=256) | st.sampled_from(valid) | st.sampled_from(valid).flatmap(mutated)


DTYPES = ["<f4", "<f8", "<f2", "i1", "<i2", "<i4", "<i8", "u1", "?"]
arrays = hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
dimensions = st.integers(0, 4) | st.sampled_from([-1, 2**31, 2**62, 2**63 - 1, -(2**63)])


def frames(*messages) -> bytes:
    out = b""
    for message in messages:
        data = message.SerializeToString()
        out += local_stream.HEADER.pack(len(data)) + data
    return out
