"""`make compose-check` runs rarely (a real engine, minutes): what its scripts read of the shipped files is checked
here."""

from __future__ import annotations

import importlib.util
import tomllib
from typing import Any

from tests.support.deploy import (
    CONFIGS,
    ROOT,
    cli_help,
    compose,
    dockerfile_arguments,
    dockerfile_stages,
    package_version,
)

# --- make compose-check ---------------------------------------------------------------------------------------


def load_tool(name: str) -> Any:
    """A script of deploy/ as a module (they are run as files, not imported as a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "deploy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_check_reads_the_shipped_files_as_they_are():
    """make compose-check runs rarely (a real engine, minutes): what it reads of the shipped files and of the
    package is checked here, so that a change to them breaks this test rather than the next check."""
    check = load_tool("compose_check")
    assert check.dockerfile_default("PYTHON_IMAGE") == dockerfile_arguments()["PYTHON_IMAGE"]
    assert check.compose_default("VALKEY_IMAGE") == compose()["services"]["redis"]["image"]
    assert (
        f"torch=={check.torch_pin()}"
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    )
    assert (CONFIGS / check.CONFIG).is_file() and check.package_version() == package_version()
    assert [c.value[0] for c in dockerfile_stages()["runtime-base"].commands if c.cmd == "USER"][
        0
    ] == check.SERVICE_USER
    assert compose()["services"]["redis"]["user"] == check.VALKEY_USER
    # The probe it runs in containers of the image imports what it reads the registry and the counters with.
    probe = load_tool("compose_probe")
    assert callable(probe.watch) and callable(probe.intrude)
    assert "--run" in cli_help("status").stdout  # `status --run RUN`, which the check runs in the trainer
