"""The package's layers and sizes, read from its source by an AST walk (nothing is imported): the floors of issue 36.

What holds today is asserted as it is. Where today's code breaks a floor, its offenders are listed below by name:
a new offender fails here, and so does a listed one that is gone, so the lists only shrink (issue 36 items 1-4
remove these)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from tests.support.running import REPO

PACKAGE = REPO / "tinker_atropos"
MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_TEST_FILE_LINES = 100, 250, 800

# Import circles between folders (a module at the package's top, errors.py or config.py, is a folder of its own):
# none since FatalError moved to errors.py and runtime.py was split by concern.
KNOWN_CIRCLES: set[frozenset[str]] = set()
# What a folder must not import: nothing below trainer/ reaches up into the drivers, and training/ (the floor
# items 1-2 build) holds no transport.
FORBIDDEN = {
    "algorithms": ("tinker_atropos.trainer",),
    "frontends": ("tinker_atropos.trainer",),
    "training": ("tinker_atropos.trainer", "tinker_atropos.frontends", "tinker_atropos.state", "grpc", "redis",
                 "fastapi", "starlette", "uvicorn", "httpx"),
}  # fmt: skip
# (file, module it imports) breaking FORBIDDEN today: none since TrainingCore and ReplayBuffer moved to training/.
KNOWN_FORBIDDEN: set[tuple[str, str]] = set()
# Functions over MAX_FUNCTION_LINES and classes over MAX_CLASS_LINES today: none since issue 36.
KNOWN_LONG: set[str] = set()


@dataclass(frozen=True)
class Module:
    path: str  # under tinker_atropos/, as "training/core.py"
    name: str  # "tinker_atropos.training.core"
    tree: ast.Module

    @property
    def folder(self) -> str:
        return folder(self.name)


@cache
def modules() -> tuple[Module, ...]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append(Module(path.relative_to(PACKAGE).as_posix(), name, ast.parse(path.read_text())))
    return tuple(found)


def folder(name: str) -> str:
    """The folder under tinker_atropos/ a module belongs to, or the module itself at the package's top."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(module: Module) -> set[str]:
    """The modules it imports, anywhere in the file (a function's late import is a dependency too), resolved to
    absolute names; ``from tinker_atropos import errors`` is tinker_atropos.errors."""
    package = module.name if module.path.endswith("__init__.py") else module.name.rpartition(".")[0]
    found = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            found |= (
                {f"{source}.{alias.name}" for alias in node.names} if source == "tinker_atropos" else {source}
            )
    return found


def folder_imports() -> dict[str, set[str]]:
    """Folder -> the other folders of the package its modules import."""
    graph: dict[str, set[str]] = {}
    for module in modules():
        targets = {folder(name) for name in imports(module) if name.startswith("tinker_atropos.")}
        graph.setdefault(module.folder, set()).update(targets - {module.folder})
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one folder: each folder of one reaches every other."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[start] = seen
    return {frozenset({a} | {b for b in reach[a] if a in reach.get(b, ())}) for a in graph if a in reach[a]}


def definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class, methods and nested functions too, by qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield prefix + child.name, child
            yield from definitions(child, f"{prefix}{child.name}.")
        else:
            yield from definitions(child, prefix)


def only_shrinks(found: set, known: set, what: str) -> None:
    """``found`` is exactly ``known``: a new offender fails, and so does a known one that is gone."""
    assert not found - known, f"new {what}: {sorted(found - known)}"
    assert not known - found, f"fixed, so to take off the known list: {sorted(known - found)}"


def test_neither_the_trainer_nor_the_rollout_imports_an_algorithm() -> None:
    """The drivers and the rollouts reach an algorithm by name through algorithms/base.py, never its module."""
    bad = {
        (module.path, name)
        for module in modules()
        if module.folder in ("trainer", "rollout")
        for name in imports(module)
        if name.startswith("tinker_atropos.algorithms.")
        and not name.startswith("tinker_atropos.algorithms.base")
    }
    assert not bad


def test_the_folders_import_one_another_without_a_new_circle() -> None:
    graph = folder_imports()
    assert {
        "trainer",
        "training",
        "rollout",
        "algorithms",
        "frontends",
        "service_host",
    } <= graph.keys()  # the walk saw the package
    only_shrinks(circles(graph), KNOWN_CIRCLES, "import circle between folders")


def test_nothing_below_the_drivers_imports_them_and_no_transport_reaches_the_training_floor() -> None:
    found = {
        (module.path, name)
        for module in modules()
        for name in imports(module)
        for forbidden in FORBIDDEN.get(module.folder, ())
        if name == forbidden or name.startswith(forbidden + ".")
    }
    only_shrinks(found, KNOWN_FORBIDDEN, "forbidden import")


def test_no_product_function_over_100_lines_and_no_class_over_250() -> None:
    found = set()
    for module in modules():
        if module.path.endswith("_pb2.py"):  # protoc's output, not written by hand
            continue
        for name, node in definitions(module.tree):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if node.end_lineno - node.lineno + 1 > limit:
                found.add(f"{module.path}:{name}")
    only_shrinks(
        found, KNOWN_LONG, f"function over {MAX_FUNCTION_LINES} lines or class over {MAX_CLASS_LINES}"
    )


def test_no_test_file_over_800_lines() -> None:
    files = sorted((REPO / "tests").rglob("test_*.py"))
    assert len(files) > 50  # the walk saw the test tree
    lines = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in files}
    long = {path: n for path, n in lines.items() if n > MAX_TEST_FILE_LINES}
    assert not long, f"split by subject: {long}"
