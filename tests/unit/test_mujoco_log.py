"""MuJoCo's warnings go to the log once ``logs.route_mujoco_warnings`` ran, imported before or after it, and no
``MUJOCO_LOG.TXT`` is written in the working directory (each case in a process of its own, in a folder of its own:
MuJoCo's handler is the process's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.running import REPO

WARN = """
import mujoco
model = mujoco.MjModel.from_xml_string("<mujoco><worldbody><body><freejoint/><geom size='1'/></body></worldbody></mujoco>")
data = mujoco.MjData(model)
data.qpos[0] = float("nan")
mujoco.mj_checkPos(model, data)  # a warning: Nan, Inf or huge value in QPOS
"""
ROUTE = "from tinker_atropos.logs import route_mujoco_warnings; route_mujoco_warnings()\n"
LAZY = "import sys; assert 'mujoco' not in sys.modules  # routing imported nothing\n"


def _run(script: str, folder: Path) -> subprocess.CompletedProcess[str]:
    environment = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "script",
    [ROUTE + LAZY + WARN, "import mujoco\n" + ROUTE + WARN],
    ids=["routed-before-import", "after-import"],
)
def test_routed_warnings_are_logged_and_no_log_file_is_written(tmp_path: Path, script: str) -> None:
    done = _run(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 MuJoCo warnings (Nan, Inf or huge value in QPOS" in done.stderr
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


def test_unrouted_mujoco_writes_its_log_file(tmp_path: Path) -> None:
    """The case above would pass on nothing: the same warning, not routed, writes the file."""
    done = _run(WARN, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "QPOS" in (tmp_path / "MUJOCO_LOG.TXT").read_text()
