"""What every handler of a queued Tinker request shares, whichever part of the engine it is in: its signature
(the request's model, number, body and deadline in; the response's body and content type out) and the two content
types a response has."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
Response = tuple[bytes, str]  # (body, content type)
Handler = Callable[[str, int, bytes, float], Response]


def json_body(**fields: Any) -> bytes:
    """A JSON response's body."""
    return json.dumps(fields).encode()
