"""MkDocs hooks of the documentation site (mkdocs.yml, ``hooks:``), run by every ``mkdocs build``.

Two things the pages in ``docs/`` cannot hold by hand without drifting:

- ``configuration.md``, the configuration reference, written here from the pydantic schema itself
  (``tinker_atropos.config.Config`` and each registered algorithm's section): every field with its dotted path,
  type, default, allowed values and description. A field added to the schema is on the page at the next build.
- files that live beside the code and are read there too (``deploy/README.md``, which the deployment tests read,
  ``bench/README.md``, the benchmark charts in ``bench/results/``): served at their repository paths, so the
  pages link to them as ``deploy/README.md`` and one copy is kept.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import AfterValidator, BaseModel
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parent.parent

# Repository files the site serves at their own paths (globs, relative to the repository).
MOUNTED = ["deploy/README.md", "deploy/redis-acl.conf", "bench/README.md", "bench/results/*.png"]

INTRO = """\
# Configuration reference

One YAML file per run, validated by pydantic and printed back resolved at start (and written to the run folder
as `config.yaml`); every field has a default, so a config states only what differs. A bad value is refused with
the field's path and what it accepts, exit code 2, before anything starts, e.g.
`env.backend: unknown env backend 'bullet'; allowed: 'gymnasium', 'mujoco' or 'module:Class' (got 'bullet')`,
and a typo gets a did-you-mean (`trainer.samples_per_updat: unknown field; did you mean 'samples_per_update'?`).

Any field can be set over the file's on the command line, as SB3's and CleanRL's users set hyper-parameters:
`tinker-atropos up CONFIG --set KEY=VALUE` (repeatable), KEY a dotted path of the tables below, VALUE read as
YAML and validated by the same schema (`--set trainer.ppo.learning_rate=3e-4 --set env.instances=4
--set trainer.model.hidden_sizes=[128,128]`). `--seed N` is `--set run.seed=N`.

The algorithm's hyper-parameters are the section named after it: `trainer.ppo` for `trainer.algorithm: ppo`,
`trainer.appo`, `trainer.sac`; the section of another algorithm than the one chosen is refused by name.

*This page is generated from the schema (`tinker_atropos/config/`, `tinker_atropos/algorithms/*/config.py`) by
`scripts/mkdocs_hooks.py` at every build of the site, so it cannot fall behind the code.*
"""


def _yaml(value: Any) -> str:
    """A value as it is written in a config file."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if annotation is type(None):
        return "null"
    if origin is not None:
        inner = ", ".join("Any" if arg is Any else _type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(metadata: list[Any]) -> Iterator[str]:
    bounds = {
        annotated_types.Ge: "≥",
        annotated_types.Gt: ">",
        annotated_types.Le: "≤",
        annotated_types.Lt: "<",
    }
    for item in metadata:
        if isinstance(item, FieldInfo):  # Annotated[int, Field(ge=1)] inside a union
            yield from _constraints(item.metadata)
        elif type(item) in bounds:
            yield f"{bounds[type(item)]} {getattr(item, type(item).__name__.lower())}"
        elif getattr(item, "pattern", None):
            yield f"matches `{item.pattern}`"
        elif isinstance(item, AfterValidator):
            try:  # a validator says what it accepts in its refusal: ask it with a value nothing accepts
                item.func("\0")
            except (ValueError, TypeError) as refusal:
                yield str(refusal).removeprefix("allowed ").removeprefix("devices: ")


def _allowed(field: FieldInfo) -> str:
    """What a field accepts beyond its type: literal values, bounds, patterns, a validator's own list."""
    parts: list[str] = []

    def walk(annotation: Any, metadata: list[Any]) -> None:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Annotated:
            walk(args[0], [*args[1:]])
            parts.extend(_constraints(list(args[1:])))
        elif origin in (typing.Union, types.UnionType):
            for arg in args:
                walk(arg, [])
        elif origin is typing.Literal:
            parts.append(", ".join(f"`{arg}`" for arg in args))

    walk(field.annotation, [])
    parts.extend(_constraints(field.metadata))
    seen: list[str] = []
    for part in parts:
        if part not in seen:
            seen.append(part)
    return "; ".join(seen)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, section model) of ``model`` and every section inside it, depth first; the trainer's
    algorithm sections under their names, as a config file writes them."""
    yield path, model
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if field.exclude:  # trainer.hyperparameters: written as trainer.<algorithm>, one section each
            from tinker_atropos.algorithms import base as algorithms

            for algorithm in algorithms.names():
                section = algorithms.algorithm(algorithm).hyperparameters
                yield from _sections(section, f"{path}.{algorithm}".lstrip("."))
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _sections(annotation, f"{path}.{name}".lstrip("."))


def config_rows() -> list[tuple[str, list[tuple[str, str, str, str, str]]]]:
    """Each section's dotted path and its rows: (field path, type, default, allowed values, description)."""
    from tinker_atropos.config import Config

    found = []
    for path, model in _sections(Config, ""):
        rows = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if field.exclude or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                continue
            default = field.get_default(call_default_factory=True)
            rows.append(
                (
                    f"{path}.{name}".lstrip("."),
                    _type_name(annotation),
                    _yaml(default),
                    _allowed(field),
                    " ".join((field.description or "").split()),
                )
            )
        if rows:
            found.append((path, rows))
    return found


def config_reference() -> str:
    """The configuration reference page, in Markdown."""
    text = [INTRO]
    for section, rows in config_rows():
        text += [
            f"\n## `{section}`\n",
            "| field | type | default | allowed | description |",
            "|---|---|---|---|---|",
        ]
        for path, type_name, default, allowed, description in rows:
            cells = [f"`{path}`", f"`{type_name}`", f"`{default}`", allowed, description]
            text.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(text) + "\n"


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "configuration.md", content=config_reference()))
    for pattern in MOUNTED:
        matches = sorted(REPO.glob(pattern))
        assert matches, f"mkdocs_hooks.MOUNTED: nothing matches {pattern}"
        for path in matches:
            files.append(File.generated(config, path.relative_to(REPO).as_posix(), abs_src_path=str(path)))
    return files
