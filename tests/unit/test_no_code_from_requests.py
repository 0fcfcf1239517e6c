"""No field of any request names code the server runs. Every call in the package that can
run code it was not written with (an import by name, an unpickling, ``torch.load`` without ``weights_only=True``,
``eval``/``exec``, an unsafe YAML or NumPy load) is found by an AST walk and must be in ``REVIEWED``, with why no
request reaches it: a new one fails here until someone has looked at it. And every ``from_pretrained`` passes
``trust_remote_code=False``, so transformers never runs a folder's own code nor asks on stdin whether to.

The real-process side: tests/services/test_tinker_hostile.py (base-model names, a planted module and pickle),
tests/services/test_tinker_base_models.py (a folder with code of its own, "y" on the trainer's stdin)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.running import REPO

PACKAGE = REPO / "tinker_atropos"
CONFIG = "a name in the run's config (the operator's), read at start; no request field reaches it"

# (module, function, call) -> why no request reaches it
REVIEWED: dict[tuple[str, str, str], str] = {
    ("environment/envs.py", "env_maker", "importlib.import_module"): CONFIG
    + " (env.id: the Tinker API builds only the run env's policy, base_models.build)",
    ("environment/backends/base.py", "backend_class", "importlib.import_module"): CONFIG + " (env.backend)",
    ("models/networks.py", "network_class", "importlib.import_module"): CONFIG + " (trainer.model.network)",
    (
        "algorithms/base.py",
        "Algorithm.build",
        "importlib.import_module",
    ): "an algorithm's learner, registered in code (algorithms/*), chosen by trainer.algorithm",
    ("algorithms/base.py", "algorithm", "importlib.import_module"): CONFIG + " (trainer.algorithm)",
    (
        "trainer/learner_replicas.py",
        "take_share",
        "pickle.loads",
    ): "a share of an update, in shared memory the trainer made for its own learner replica",
    (
        "trainer/learner_channels.py",
        "Channel.receive",
        "pickle.loads",
    ): "a message from the other end of a socket pair only the trainer and its own replica hold (nothing listens)",
    (
        "state/checkpoint_files.py",
        "read_checkpoint",
        "torch.load",
    ): "the run folder's own experience-loop checkpoints (at start, evaluation, export); a Tinker path never "
    "reaches it (Tinker checkpoints load with weights_only=True)",
}

IMPORTS = {"importlib.import_module", "import_module", "__import__", "runpy.run_module", "runpy.run_path"}
UNPICKLES = {"pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.loads", "dill.loads"}
EVALS = {"eval", "exec", "compile"}  # the builtins: ``module.eval()`` and ``re.compile`` are attributes
UNSAFE_YAML = {"yaml.load", "yaml.unsafe_load", "yaml.full_load"}


def _name(node: ast.expr) -> str:
    """The dotted name a call is made through (``torch.load``), "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)):
        return f"{base}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> object:
    """The literal value of a call's keyword (None when absent or not a literal)."""
    found = next((k.value for k in call.keywords if k.arg == name), None)
    return found.value if isinstance(found, ast.Constant) else None


def runs_code(call: ast.Call) -> str | None:
    """The callee of a call that can run code it was not written with, else None."""
    callee = _name(call.func)
    if callee in IMPORTS | UNPICKLES | EVALS | UNSAFE_YAML:
        return callee
    if callee == "torch.load" and _keyword(call, "weights_only") is not True:
        return callee
    if callee in {"np.load", "numpy.load"} and _keyword(call, "allow_pickle") is True:
        return callee
    return None


def _calls(tree: ast.AST, scope: str = "") -> list[tuple[str, ast.Call]]:
    """Every call with the qualified name of the function (or class) it is in."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found += _calls(node, f"{scope}.{node.name}" if scope else node.name)
            continue
        if isinstance(node, ast.Call):
            found.append((scope, node))
        found += _calls(node, scope)
    return found


def _package_calls(root: Path) -> list[tuple[str, str, ast.Call]]:
    return [
        (str(path.relative_to(root)), scope, call)
        for path in sorted(root.rglob("*.py"))
        for scope, call in _calls(ast.parse(path.read_text(), str(path)))
    ]


def code_runners(root: Path) -> dict[tuple[str, str, str], int]:
    """Each call under ``root`` that can run code (``runs_code``), keyed as ``REVIEWED`` is, with its line."""
    return {
        (module, scope, callee): call.lineno
        for module, scope, call in _package_calls(root)
        if (callee := runs_code(call)) is not None
    }


def test_the_walk_finds_every_kind_of_call_that_runs_code(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(
        "import importlib, pickle, re, torch, yaml\n"
        "def route(body):\n"
        "    importlib.import_module(body); __import__(body); pickle.loads(body); eval(body); exec(body)\n"
        "    torch.load(body); torch.load(body, weights_only=False); yaml.load(body)\n"
        "    torch.load(body, weights_only=True); yaml.safe_load(body); re.compile(body); body.eval()\n"
    )
    found = sorted(callee for _, _, callee in code_runners(tmp_path))  # a key per callee of a function
    assert found == sorted(
        ["importlib.import_module", "__import__", "pickle.loads", "eval", "exec", "torch.load", "yaml.load"]
    )


def test_every_call_that_can_run_code_is_reviewed() -> None:
    """A new call fails here until it is added to ``REVIEWED`` with why no request reaches it; a reviewed one that
    is gone fails too, so the list stays the package's."""
    found = code_runners(PACKAGE)
    new = {
        f"{module}:{line} {scope}: {callee}"
        for (module, scope, callee), line in found.items()
        if (module, scope, callee) not in REVIEWED
    }
    assert not new, f"review these (what reaches them?) and list them in REVIEWED: {sorted(new)}"
    assert not set(REVIEWED) - set(found), f"gone from the package: {sorted(set(REVIEWED) - set(found))}"


def test_transformers_never_runs_a_folders_own_code() -> None:
    """Every call that reads a model folder passes ``trust_remote_code=False``: not None, which asks on stdin."""
    readers = [
        (module, call.lineno, _keyword(call, "trust_remote_code"))
        for module, _, call in _package_calls(PACKAGE)
        if _name(call.func).endswith(".from_pretrained")
    ]
    assert readers and all(trusted is False for *_, trusted in readers), readers
