"""Scored groups read from a request body without a Python object per number. A group's rows of numbers (token
ids, masks, log-probs, advantages) are most of a large body, and read as Python lists each 4-digit id costs 36 bytes
(7 times its JSON), a float 32, built while pydantic holds the GIL: a 95 kB gzip post inflating to 62 MiB cost the
API 11 times that and held ``/status`` for 0.5 s. Here those rows stay their compact JSON,
checked by numpy (which lets go of the GIL) with each row's length, which is all the API needs of them; the rest of
a group is read as before, a bounded number of values."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pydantic_core

from tinker_atropos.frontends.bodies import SCAN_BYTES, BodyError, Separators

# the row fields kept compact, and what their numbers may be: token ids (in [0, 10**9): none refused), integers,
# floats (each with a "." or an exponent, so that a client reads floats back, as pydantic would write them)
ROW_FIELDS = {
    "tokens": "ids",
    "masks": "ints",
    "inference_logprobs": "floats",
    "advantages": "floats",
    "ref_logprobs": "floats",
}
ROWS_BYTES = 1 << 12  # a row field smaller is read as Python lists: a few hundred numbers, microseconds
# What a body may have read as Python objects, its compact rows aside: values (commas), strings (quotes, escaped
# ones too, over 2) and object keys (colons, those in strings too). The first bound of each keeps each call that
# reads, validates or writes them (a field's, a group's) under about 0.15 s holding the GIL on this machine (a value
# takes up to 75 ns, a string 150, a key 1.4 us); the second, of ``limit`` the bytes a body may have, their memory
# under 7 times the bound (measured at the most: a value 57 bytes, a float that was "0" and its slots; a string 105;
# a key 160).
VALUES, STRINGS, KEYS = (1 << 21, 8), (1 << 20, 16), (1 << 16, 64)

COMMA, MINUS, ZERO, OPEN, CLOSE = b",-0[]"
SPACES = b" \t\n\r"
EXPONENT = b"eE"
# the bytes a number of each kind may hold besides digits, and its longest JSON with the separator before it: an
# id of 10 digits may pass 2**31; a float of more than 24 bytes was not written by a shortest round-trip repr
NUMBER_BYTES = {"ids": b"", "ints": b"-", "floats": b"-+.eE"}
LONGEST = {"ids": 10, "ints": None, "floats": 25}


class CompactRows:
    """A list of rows of numbers as its compact JSON and each row's length: what the API needs of them (lined up,
    under the trainer's ``max_token_len``, stored) without a Python object per number. Made only where pydantic
    reads the values its bytes say, and accepts them; pydantic would write the same bytes but for a float's
    spelling ("1e-05" for its "1e-5"), which a client reads as the same float."""

    __slots__ = ("commas", "json", "lengths")

    def __init__(self, json: np.ndarray, lengths: list[int], commas: int) -> None:
        self.json, self.lengths, self.commas = json, lengths, commas

    def __len__(self) -> int:
        return len(self.lengths)


def row_lengths(rows: Any) -> list[int | None]:
    """Each row's length (None for one that is no list) of a row field read by ``GroupReader``."""
    if isinstance(rows, CompactRows):
        return list(rows.lengths)
    return [len(row) if isinstance(row, list) else None for row in rows]


def compact_rows(raw: Any, kind: str) -> CompactRows | None:
    """``raw`` (well-formed JSON: msgspec read it) as CompactRows when it is a non-empty list of lists of numbers of
    ``kind`` (``NUMBER_BYTES``); None otherwise, and where pydantic would read another value than its bytes say (a
    mask's ``-0``, a float's exponent of 3 digits, which may be past a float's range)."""
    data = _without_spaces(np.frombuffer(raw, np.uint8), kind)
    found = _numbers(data, kind) if data is not None else None
    if found is None:
        return None
    positions, before, commas = found
    if len(positions) < 4:  # no row
        return None
    # "[", then "[" and "]" for each row, then "]": no deeper list, no number outside a row
    pattern = np.ones(len(positions), bool)
    pattern[2::2] = pattern[-1] = False
    if len(positions) % 2 or np.any((data[positions] == OPEN) != pattern):
        return None
    opens, closes = positions[1:-1:2], positions[2:-1:2]
    ends = (positions[0], positions[-1], opens[0], closes[-1])
    if ends != (0, len(data) - 1, 1, len(data) - 2) or np.any(opens[1:] != closes[:-1] + 2):
        return None
    return CompactRows(data, (before[2:-1:2] - before[1:-1:2]).tolist(), commas)


def _digits(part: np.ndarray) -> np.ndarray:
    return (part - ZERO) < 10  # uint8 wraps: a byte below "0" is over 9


def _without_spaces(data: np.ndarray, kind: str) -> np.ndarray | None:
    """``data`` without its whitespace (a copy only if it has some); None with a byte no list of rows of numbers of
    ``kind`` holds."""
    spaces = 0
    for start in range(0, len(data), SCAN_BYTES):
        part = data[start : start + SCAN_BYTES]
        found = [np.count_nonzero(part == c) for c in SPACES]
        spaces += sum(found)
        found += [np.count_nonzero(part == c) for c in (COMMA, OPEN, CLOSE, *NUMBER_BYTES[kind])]
        if sum(found) + np.count_nonzero(_digits(part)) != len(part):
            return None
    if not spaces:
        return data
    kept, filled = np.empty(len(data) - spaces, np.uint8), 0
    for start in range(0, len(data), SCAN_BYTES):
        part = data[start : start + SCAN_BYTES]
        part = part[~np.isin(part, np.frombuffer(SPACES, np.uint8))]
        kept[filled : filled + len(part)] = part
        filled += len(part)
    return kept


def _numbers(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The positions of ``data``'s brackets, the numbers before each, its commas: read a slice at a time, each
    ending before a separator so that the numbers in it are whole; None for a number pydantic reads otherwise."""
    positions, before, numbers, commas, start = [], [], 0, 0, 0
    while start < len(data):
        part = data[start : start + SCAN_BYTES]
        separators = np.flatnonzero((part == COMMA) | (part == OPEN) | (part == CLOSE))
        if start + len(part) < len(data):  # not the last slice: it ends before its last separator
            if len(separators) < 2:
                return None  # a number of a MiB
            part, separators = part[: separators[-1]], separators[:-1]
        # each separator and the number after it
        spans = np.diff(separators, append=len(part))
        if not len(separators) or not _plain(part, separators, spans, kind):
            return None
        counted = spans > 1
        marks = np.flatnonzero(part[separators] != COMMA)
        positions.append(separators[marks] + start)
        before.append(numbers + np.cumsum(counted)[marks] - counted[marks])
        numbers += int(np.count_nonzero(counted))
        commas += len(separators) - len(marks)
        start += len(part)
    return np.concatenate(positions), np.concatenate(before), commas


def _plain(part: np.ndarray, separators: np.ndarray, spans: np.ndarray, kind: str) -> bool:
    """Whether pydantic reads each number of ``part`` (whole numbers, each after one of ``separators``, ``spans``
    long with it) as its bytes say, and accepts it."""
    longest = LONGEST[kind]
    if longest is not None and np.any(spans > longest):
        return False
    if kind == "ints":
        return not np.any((part[:-1] == MINUS) & (part[1:] == ZERO))
    if kind != "floats":
        return True
    exponents = (part == EXPONENT[0]) | (part == EXPONENT[1])
    marked = np.add.reduceat(exponents | (part == ord(".")), separators, dtype=np.int64)
    if np.any((spans > 1) & (marked == 0)):
        return False  # an integer: pydantic writes it back as a float
    digits, signs = _digits(part), (part == ord("-")) | (part == ord("+"))
    three = digits[1:-2] & digits[2:-1] & digits[3:]  # digits at i + 1, i + 2, i + 3
    signed = signs[1:-3] & three[1:]
    return not (np.any(exponents[:-3] & three) or np.any(exponents[:-4] & signed))


class GroupReader:
    """Reads a scored-data body for ``JSONBodies`` (``read``): each group's rows of numbers (``ROW_FIELDS``) as
    CompactRows where they may be, its other fields (those of ``fields``; pydantic ignores the rest) with pydantic's ``from_json``, as the whole
    body was read before. A body msgspec cannot read as groups (a NaN, which JSON has not; no object) is read
    whole as before. Either way 413, before reading it, for a body with more values, strings or keys outside its
    compact rows than ``VALUES``, ``STRINGS``, ``KEYS`` allow."""

    def __init__(self, fields: tuple[str, ...], limit: int) -> None:
        group = msgspec.defstruct("Group", [(name, msgspec.Raw, msgspec.Raw()) for name in fields])
        self.one, self.many = msgspec.json.Decoder(group), msgspec.json.Decoder(list[group])
        self.fields = fields
        self.most = [min(most, limit // share) for most, share in (VALUES, STRINGS, KEYS)]

    def read(self, body: bytes, found: Separators, listed: bool) -> Any:
        """The group (a list of them: ``listed``) in ``body`` as ``from_json`` would read it, but for its rows."""
        try:
            read = self.many.decode(body) if listed else [self.one.decode(body)]
        except msgspec.DecodeError:
            self._affordable(found, 0)
            return pydantic_core.from_json(body)
        raws = [{name: getattr(g, name) for name in self.fields if len(getattr(g, name))} for g in read]
        compacted = [
            {
                name: rows
                for name, kind in ROW_FIELDS.items()
                if len(group.get(name, b"")) >= ROWS_BYTES
                and (rows := compact_rows(group[name], kind)) is not None
            }
            for group in raws
        ]
        self._affordable(found, sum(r.commas for rows in compacted for r in rows.values()))
        groups = [
            {
                name: rows[name] if name in rows else pydantic_core.from_json(bytes(raw))
                for name, raw in group.items()
            }
            for group, rows in zip(raws, compacted, strict=True)
        ]
        return groups if listed else groups[0]

    def _affordable(self, found: Separators, compact_commas: int) -> None:
        counts = (found.commas + 1 - compact_commas, found.quotes // 2, found.colons)
        names = ("JSON values", "strings", "colons (object keys)")
        for count, most, what in zip(counts, self.most, names, strict=True):
            if count > most:
                raise BodyError(
                    413,
                    f"the body holds {count} {what} outside its rows of numbers; at most {most} are read "
                    f"here (atropos.max_request_mb bounds them): send the groups in several posts",
                )


def encode(fields: dict[str, Any]) -> bytes:
    """A validated group's JSON as stored and digested (to recognise a retried post): the bytes
    ``pydantic_core.to_json`` writes for it, its CompactRows as they are; each field serialised on its own, so that
    a large group holds the GIL a field at a time."""
    parts: list[Any] = []
    for name, value in fields.items():
        json = value.json if isinstance(value, CompactRows) else pydantic_core.to_json(value)
        parts += (b",", pydantic_core.to_json(name), b":", json)
    parts[0] = b"{"
    return b"".join([*parts, b"}"])
