"""Reading a run config: the YAML file, ``--set`` settings over it, validation, and the refusal that names each bad
field, what it accepts and, for a typo, the field meant."""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tinker_atropos.config.root import Config
from tinker_atropos.config.trainer import TrainerSection
from tinker_atropos.config.validation_errors import SELF_EXPLAINED


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and what it accepts."""


def _known_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section at ``loc`` (a path of field names from the top of the config)."""
    from tinker_atropos.algorithms import base as algorithms

    model: type[BaseModel] = Config
    for name in loc:
        if model is TrainerSection and str(name) in algorithms.names():
            model = algorithms.algorithm(str(name)).hyperparameters
            continue
        field = model.model_fields.get(str(name))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        model = field.annotation
    return [name for name, field in model.model_fields.items() if not field.exclude]


_GOT = reprlib.Repr()  # a given value, shown bounded: it may be huge (a YAML alias bomb)
_GOT.maxlevel, _GOT.maxstring, _GOT.maxother = 2, 100, 100
_GOT.maxlist = _GOT.maxtuple = _GOT.maxdict = _GOT.maxset = 4


def _union_tag(part: Any) -> bool:
    """Whether a location part names a branch of a union (``constrained-int``, ``literal['auto']``), not a field."""
    return isinstance(part, str) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part)


def _merged_unions(items: list[Any]) -> list[Any]:
    """One error per field of a union type (e.g. a size or 'auto'), its branches' wants joined by 'or'."""
    merged: dict[tuple[Any, ...], Any] = {}
    for item in items:
        loc = tuple(item["loc"])
        if item["type"] == "extra_forbidden" or len(loc) < 2 or not _union_tag(loc[-1]):
            merged[loc] = item
            continue
        want = item["msg"].removeprefix("Value error, ")
        if loc[:-1] in merged:
            first = merged[loc[:-1]]
            first["msg"] += ", or " + want.removeprefix("Input should be ")
        else:
            merged[loc[:-1]] = {**item, "loc": loc[:-1], "msg": want}
    return list(merged.values())


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:" if source else "invalid config:"]
    for item in _merged_unions(error.errors()):
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        got = "" if item["type"] in ("missing", *SELF_EXPLAINED) else f" (got {_GOT.repr(item['input'])})"
        if item["type"] == "extra_forbidden":
            known = _known_fields(item["loc"][:-1])
            close = difflib.get_close_matches(str(item["loc"][-1]), known, n=1)
            message = f"unknown field; did you mean {close[0]!r}?" if close else "unknown field"
            message += f" (fields here: {', '.join(known)})" if known and not close else ""
            got = ""
        lines.append(f"  {field}: {message}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def apply_settings(data: dict[str, Any], settings: Sequence[str]) -> None:
    """Write ``KEY=VALUE`` settings (``up --set``) into a config's data, where the schema then validates them:
    KEY is a dotted path of fields (``trainer.ppo.learning_rate``), VALUE is read as YAML (``3e-4``, ``true``,
    ``[64, 64]``, ``null``; quote it to keep a number a string). ConfigError for a setting that is no
    KEY=VALUE, whose VALUE is no YAML, or whose path goes through a value that is not a section."""
    for setting in settings:
        key, equals, text = setting.partition("=")
        path = key.strip().split(".")
        if not equals or not all(path):
            raise ConfigError(
                f"--set {setting!r}: expected KEY=VALUE, KEY a dotted path such as trainer.ppo.learning_rate"
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {setting!r}: the value is not valid YAML: {error}") from None
        section = data
        for depth, name in enumerate(path[:-1]):
            if section.get(name) is None:  # absent, or an empty section in the YAML
                section[name] = {}
            section = section[name]
            if not isinstance(section, dict):
                raise ConfigError(
                    f"--set {setting!r}: {'.'.join(path[: depth + 1])} is a value, not a section "
                    f"(it holds {_GOT.repr(section)})"
                )
        section[path[-1]] = value


def load_config(path: str | Path, settings: Sequence[str] = ()) -> Config:
    """Read and validate a YAML run config, with ``settings`` (``KEY=VALUE``, see ``apply_settings``) over it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise ConfigError(f"config {path} nests too deeply to be a run config") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"config {where} is not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(data).__name__}")
    apply_settings(data, settings)
    return parse_config(data, f"{path} with --set {' '.join(settings)}" if settings else str(path))
