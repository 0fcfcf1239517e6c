"""The line errors the sections' own checks raise, so that a config's mistakes are reported together, each at
its full path; and which of them explain themselves (``loading`` shows no given value beside those)."""

from __future__ import annotations

from typing import Any

from pydantic_core import InitErrorDetails, PydanticCustomError

# their messages name what was given, or must not show it (a Redis URL may hold a password)
SELF_EXPLAINED = {
    "renamed",
    "unknown_algorithm",
    "other_algorithm",
    "redis_url",
    "unserved_model",
    "one_learner",
}


def line_error(kind: str, field: str, message: str, value: Any) -> InitErrorDetails:
    """A line error of kind ``kind`` at ``field``: errors built so are raised together, in one ValidationError."""
    message = message.replace("{", "{{").replace("}", "}}")  # a template to pydantic
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=(field,), input=value)


def nested_error(item: Any, *prefix: str) -> InitErrorDetails:
    """A line error of a nested validation, as one of the trainer section's (at ``prefix`` + its path)."""
    message = item["msg"].removeprefix("Value error, ")
    return line_error(item["type"], "", message, item["input"]) | {"loc": (*prefix, *item["loc"])}
