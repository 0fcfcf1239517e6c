"""JSON fields of Redis records, which anyone who reaches Redis may have written."""

from __future__ import annotations

import json
from typing import Any


def parse_json(raw: str | bytes) -> Any:
    """``raw`` parsed as JSON; ValueError for anything else, nesting too deep included (the decoder recurses
    once per level and raises RecursionError, which the readers that skip bad records would not catch)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
