"""The package's floors and sizes, read from its source by an AST walk (nothing is imported).

The floors are data (``FLOORS``: which room may import which: a folder, or inside the
``ROOMED`` folders each sub-package or module); every import of every module is checked against
them, a function's late import and a ``TYPE_CHECKING`` one included, and the training floor is followed
transitively: whatever ``training/`` reaches stays on its floor or below and imports no transport. Each check is a
function of a package root that fails on an empty tree, and a planted forbidden import in a copy of the package
fails the check that guards it (the last tests), so none of them can pass by seeing nothing."""

from __future__ import annotations

import ast
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.support.running import REPO

PACKAGE = REPO / "tinker_atropos"
MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_TEST_FILE_LINES = 100, 200, 800

# Room -> the rooms it may import (space-separated). A room is a folder under tinker_atropos/ (or a module at the
# package's top); in the folders of ROOMED, each sub-package or module is a room of its own (``tinker_api/http``,
# ``trainer/experience_loop``), so floors hold inside them too. Read bottom to top: the ground imports nothing; ``training/`` (the core, losses,
# the guard) sits on models and the protocol only; algorithms on training; the services' hosts, then the services,
# the front-ends (whose three processes, ``frontends/atropos``, ``frontends/inference`` and ``tinker_api/http``,
# never import one another), the Tinker API (its HTTP app and its engine meeting only at its store, all above its
# wire), the trainer's drivers; the launcher on everything.
ROOMED = frozenset({"frontends", "tinker_api", "trainer"})
GROUND = ("errors", "logs", "processes", "sections", "device", "prometheus", "protocol", "models")
FLOORS: dict[str, frozenset[str]] = {
    room: frozenset(below.split())
    for room, below in {
        **dict.fromkeys(GROUND, ""),
        "security": "errors logs",
        "state": "errors processes protocol security",
        "sampling": "models",
        "training": "models protocol",
        "algorithms": "models protocol sections training",
        "config": "algorithms errors sections state",
        "service_host": "config logs processes prometheus protocol security state",
        "experience_source": "protocol security state",
        "environment": "config errors logs protocol security service_host state",
        "rollout": "config device environment models processes protocol security service_host state",
        # the front-ends' shared kit, then the Atropos trajectory API and the inference endpoint
        "frontends/__init__": "",
        "frontends/http": "errors logs security state",
        "frontends/bodies": "frontends/http",
        "frontends/atropos": "config frontends/bodies frontends/http protocol service_host state",
        "frontends/inference": "frontends/bodies frontends/http models sampling training",
        # the Tinker API: wire <- base_models, store <- http | engine <- service (the trainer's driver)
        "tinker_api/__init__": "",
        "tinker_api/wire": "sampling training",
        "tinker_api/base_models": "config environment errors models tinker_api/wire training",
        "tinker_api/store": "state tinker_api/wire",
        "tinker_api/http": (
            "config errors frontends/bodies frontends/http logs security tinker_api/base_models "
            "tinker_api/store tinker_api/wire training"
        ),
        "tinker_api/engine": (
            "config models sampling security state tinker_api/base_models tinker_api/store tinker_api/wire "
            "training"
        ),
        "tinker_api/service": (
            "config environment frontends/http protocol state tinker_api/base_models tinker_api/engine "
            "tinker_api/http tinker_api/store training"
        ),
        # the trainer: its parts, then its three drivers, then the service that composes them
        "trainer/__init__": "",
        "trainer/figures": "state",
        "trainer/tensorboard": "config errors state",
        "trainer/atropos_figures": "trainer/tensorboard training",
        "trainer/learner_channels": "",
        "trainer/learner_replicas": "algorithms errors protocol trainer/learner_channels training",
        "trainer/batcher": "algorithms config logs protocol trainer/figures",
        "trainer/checkpointing": "algorithms config protocol state trainer/figures training",
        "trainer/periodic_eval": "config environment models state trainer/tensorboard training",
        "trainer/publishing": "algorithms models security state training",
        "trainer/trajectory_api": "config state",
        "trainer/updates": (
            "algorithms config device environment errors protocol trainer/learner_replicas training"
        ),
        "trainer/experience_loop": (
            "algorithms config device environment errors protocol security state trainer/batcher "
            "trainer/checkpointing trainer/figures trainer/periodic_eval trainer/publishing trainer/updates "
            "trainer/tensorboard training"
        ),
        "trainer/atropos_loop": (
            "config errors frontends/http frontends/inference models protocol state tinker_api/base_models "
            "trainer/atropos_figures trainer/checkpointing trainer/figures trainer/tensorboard "
            "trainer/trajectory_api training"
        ),
        "trainer/service": (
            "config device protocol service_host state tinker_api/service trainer/atropos_loop "
            "trainer/checkpointing trainer/experience_loop trainer/figures trainer/tensorboard training"
        ),
        "launcher": (
            "config environment errors frontends/atropos frontends/http frontends/inference logs models processes "
            "rollout security service_host state tinker_api/base_models tinker_api/engine tinker_api/store "
            "tinker_api/wire trainer/service training"
        ),
        "tinker_atropos": "environment",  # the package's __init__: the vector envs, on first use
        "__main__": "launcher",
    }.items()
}

TRAINING = "training"
# libraries that move bytes between processes: none is reached from the training floor
TRANSPORTS = (
    "grpc",
    "redis",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "aiohttp",
    "requests",
    "websockets",
)


@dataclass(frozen=True)
class Module:
    path: str  # under the package root, as "training/core.py"
    name: str  # "tinker_atropos.training.core"
    tree: ast.Module

    @property
    def room(self) -> str:
        return room(self.name)

    @property
    def folder(self) -> str:
        """The folder under tinker_atropos/ (or the module at its top)."""
        return room(self.name).split("/")[0]


def read_modules(root: Path) -> tuple[Module, ...]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append(Module(path.relative_to(root).as_posix(), name, ast.parse(path.read_text())))
    return tuple(found)


@cache
def package_modules() -> tuple[Module, ...]:
    return read_modules(PACKAGE)


def room(name: str) -> str:
    """The room a module is in: its folder under tinker_atropos/ (or the module itself at the package's top), or in
    a folder of ROOMED, the folder and its sub-package or module (``tinker_api/http``; ``trainer/__init__``)."""
    parts = name.split(".")
    if len(parts) == 1:
        return parts[0]
    if parts[1] in ROOMED:
        return f"{parts[1]}/{parts[2] if len(parts) > 2 else '__init__'}"
    return parts[1]


def imports(module: Module) -> set[str]:
    """The modules it imports, anywhere in the file (a function's late import, a ``TYPE_CHECKING`` block), resolved
    to absolute names; ``from tinker_atropos import errors`` is tinker_atropos.errors."""
    package = module.name if module.path.endswith("__init__.py") else module.name.rpartition(".")[0]
    found = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            # a package's modules by name: ``from tinker_atropos.tinker_api import wire`` is tinker_api/wire's
            named = source == "tinker_atropos" or source.removeprefix("tinker_atropos.") in ROOMED
            found |= {f"{source}.{alias.name}" for alias in node.names} if named else {source}
    return found


def own(name: str) -> bool:
    return name == "tinker_atropos" or name.startswith("tinker_atropos.")


def seen(modules: tuple[Module, ...]) -> None:
    """A check that saw no module, or not every floor, checked nothing: it fails."""
    folders = {module.folder for module in modules}
    assert modules and {TRAINING, "trainer", "frontends", "state"} <= folders, (
        f"the walk saw {sorted(folders)}"
    )


# ------------------------------------------------------------------------------ the checks, each of a root


def check_floors(root: Path = PACKAGE) -> None:
    """Every room has a floor, and every import of the package's own modules is one its floor allows."""
    modules = package_modules() if root == PACKAGE else read_modules(root)
    seen(modules)
    undeclared = {module.room for module in modules} - FLOORS.keys()
    assert not undeclared, f"rooms without a floor in FLOORS: {sorted(undeclared)}"
    checked, breaches = 0, set()
    for module in modules:
        for name in filter(own, imports(module)):
            checked += 1
            target = room(name)
            if target != module.room and target not in FLOORS[module.room]:
                breaches.add((module.path, name))
    assert checked > 300, f"only {checked} imports of the package's own modules seen"
    assert not breaches, f"imports their floor does not allow (FLOORS): {sorted(breaches)}"


def check_training_floor(root: Path = PACKAGE) -> None:
    """What ``training/`` reaches, import after import, stays on its floor or below and imports no transport."""
    modules = package_modules() if root == PACKAGE else read_modules(root)
    seen(modules)
    by_name = {module.name: module for module in modules}
    allowed = {TRAINING} | FLOORS[TRAINING]
    todo = [module for module in modules if module.folder == TRAINING]
    reached: dict[str, Module] = {module.name: module for module in todo}
    while todo:
        for name in filter(own, imports(todo.pop())):
            # ``from tinker_atropos.models import spec`` names a module; ``from ..core import X`` its module
            target = by_name.get(name) or by_name.get(name.rpartition(".")[0])
            if target is not None and target.name not in reached:
                reached[target.name] = target
                todo.append(target)
    assert len(reached) > 5, f"the training floor reached {sorted(reached)}"
    above = sorted(name for name, module in reached.items() if module.folder not in allowed)
    assert not above, f"the training floor reaches above itself: {above}"
    transports = sorted(
        (module.path, name)
        for module in reached.values()
        for name in imports(module)
        if name.split(".")[0] in TRANSPORTS
    )
    assert not transports, f"the training floor reaches a transport: {transports}"


def check_no_algorithm_import(root: Path = PACKAGE) -> None:
    """The drivers and the rollouts reach an algorithm by name through algorithms/base.py, never its module."""
    modules = package_modules() if root == PACKAGE else read_modules(root)
    seen(modules)
    drivers = [module for module in modules if module.folder in ("trainer", "rollout")]
    assert len(drivers) > 5
    bad = {
        (module.path, name)
        for module in drivers
        for name in imports(module)
        if name.startswith("tinker_atropos.algorithms.")
        and not name.startswith("tinker_atropos.algorithms.base")
    }
    assert not bad, f"an algorithm's module imported by name: {sorted(bad)}"


def check_no_circle(root: Path = PACKAGE) -> None:
    """No module reaches itself through the imports of others, inside a room too (a ``TYPE_CHECKING`` import
    counts: the circle is in the design even where Python never runs it)."""
    modules = package_modules() if root == PACKAGE else read_modules(root)
    seen(modules)
    by_name = {module.name: module for module in modules}
    graph = {
        module.name: {
            target
            for name in filter(own, imports(module))
            if (target := name if name in by_name else name.rpartition(".")[0]) in by_name
            and target != module.name
        }
        for module in modules
    }
    assert sum(map(len, graph.values())) > 300, "the walk saw too few imports"
    done: set[str] = set()
    for start in graph:
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                done.add(path.pop())
                stack.pop()
            elif target in path:
                circle = path[path.index(target) :] + [target]
                raise AssertionError(f"an import circle: {' -> '.join(circle)}")
            elif target not in done:
                path.append(target)
                stack.append(iter(sorted(graph[target])))


def definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class, methods and nested functions too, by qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield prefix + child.name, child
            yield from definitions(child, f"{prefix}{child.name}.")
        else:
            yield from definitions(child, prefix)


def check_sizes(root: Path = PACKAGE) -> None:
    """No function over 100 lines, no class over 200 (protoc's output aside)."""
    modules = package_modules() if root == PACKAGE else read_modules(root)
    seen(modules)
    long = set()
    for module in modules:
        if module.path.endswith("_pb2.py"):
            continue
        for name, node in definitions(module.tree):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if node.end_lineno - node.lineno + 1 > limit:
                long.add(f"{module.path}:{name}")
    assert not long, (
        f"over {MAX_FUNCTION_LINES} lines (a function) or {MAX_CLASS_LINES} (a class): {sorted(long)}"
    )


CHECKS: dict[str, Callable[[Path], None]] = {
    "floors": check_floors,
    "training floor": check_training_floor,
    "no algorithm import": check_no_algorithm_import,
    "sizes": check_sizes,
    "no circle": check_no_circle,
}


# ------------------------------------------------------------------------------ the package as it is


@pytest.mark.parametrize("check", CHECKS)
def test_the_package_holds(check: str) -> None:
    CHECKS[check](PACKAGE)


def test_the_floors_are_floors() -> None:
    """FLOORS names only rooms of the package and has no circle: each room can be put above all it imports."""
    rooms = {module.room for module in package_modules()}
    assert FLOORS.keys() == rooms, sorted(FLOORS.keys() ^ rooms)
    assert all(below <= FLOORS.keys() for below in FLOORS.values())
    placed: set[str] = set()
    while len(placed) < len(FLOORS):
        ready = {name for name, below in FLOORS.items() if name not in placed and below <= placed}
        assert ready, f"a circle among {sorted(FLOORS.keys() - placed)}"
        placed |= ready


def test_no_test_file_over_800_lines() -> None:
    files = sorted((REPO / "tests").rglob("test_*.py"))
    assert len(files) > 50  # the walk saw the test tree
    lines = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in files}
    long = {path: n for path, n in lines.items() if n > MAX_TEST_FILE_LINES}
    assert not long, f"split by subject: {long}"


# ------------------------------------------------------------------------------ the checks can fail


@pytest.mark.parametrize("check", CHECKS)
def test_each_check_fails_on_an_empty_tree(tmp_path: Path, check: str) -> None:
    empty = tmp_path / "tinker_atropos"
    empty.mkdir()
    with pytest.raises(AssertionError):
        CHECKS[check](empty)


LONG_FUNCTION = "\n\ndef planted():\n" + "    x = 1\n" * 101
# (file to append to, what is planted, the check that must fail, what its message names)
PLANTS = {
    "a front-end importing the rollout": (
        "frontends/atropos/app.py",
        "\nfrom tinker_atropos.rollout import service as _planted\n",
        "floors",
        "frontends/atropos/app.py",
    ),
    "training importing a Redis reader, late": (
        "training/core.py",
        "\n\ndef _planted():\n    from tinker_atropos.experience_source import ExperienceSource\n",
        "floors",
        "tinker_atropos.experience_source",
    ),
    "an algorithm importing a driver for its types": (
        "algorithms/base.py",
        "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tinker_atropos.trainer.service import X\n",
        "floors",
        "tinker_atropos.trainer.service",
    ),
    "the trajectory API reaching the Tinker API's store": (
        "frontends/atropos/app.py",
        "\nfrom tinker_atropos.tinker_api.store import Store as _planted\n",
        "floors",
        "tinker_atropos.tinker_api.store",
    ),
    "the Tinker engine importing a driver of the trainer": (
        "tinker_api/engine/handlers.py",
        "\n\ndef _planted():\n    from tinker_atropos.trainer import experience_loop\n",
        "floors",
        "tinker_atropos.trainer.experience_loop",
    ),
    "the Tinker HTTP app importing its engine": (
        "tinker_api/http/routes/samples.py",
        "\nfrom tinker_atropos.tinker_api.engine import worker as _planted\n",
        "floors",
        "tinker_api/http/routes/samples.py",
    ),
    "one trainer driver importing another": (
        "trainer/atropos_loop.py",
        "\nfrom tinker_atropos.trainer.experience_loop import ExperienceLoop as _p\n",
        "floors",
        "trainer/atropos_loop.py",
    ),
    "a circle inside the Tinker engine, for types only": (
        "tinker_api/engine/saving.py",
        "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tinker_atropos.tinker_api.engine.live_models import X\n",
        "no circle",
        "tinker_atropos.tinker_api.engine.saving",
    ),
    "a folder without a floor": (
        "newfloor/__init__.py",
        "import tinker_atropos.errors\n",
        "floors",
        "newfloor",
    ),
    "the training floor reaching Redis through a model": (
        "models/spec.py",
        "\nimport redis as _planted\n",
        "training floor",
        "redis",
    ),
    "the training floor reaching gRPC through the protocol": (
        "protocol/trajectory.py",
        "\n\ndef _planted():\n    import grpc\n",
        "training floor",
        "grpc",
    ),
    "a driver importing an algorithm's module": (
        "trainer/service.py",
        "\nfrom tinker_atropos.algorithms.ppo import learner as _planted\n",
        "no algorithm import",
        "algorithms.ppo",
    ),
    "a function over 100 lines": ("state/keys.py", LONG_FUNCTION, "sizes", "state/keys.py:planted"),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_forbidden_import_fails_its_check(tmp_path: Path, plant: str) -> None:
    file, text, check, named = PLANTS[plant]
    copy = tmp_path / "tinker_atropos"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    CHECKS[check](copy)  # the copy holds, as the package does
    (copy / file).parent.mkdir(exist_ok=True)
    with (copy / file).open("a") as planted:
        planted.write(text)
    with pytest.raises(AssertionError, match=named):
        CHECKS[check](copy)
