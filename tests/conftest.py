"""Shared fixtures: a real Valkey server per test module and the service processes a test starts (their helpers
are in tests/support/processes.py)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import redis
import tinker
import torch

from tests.support.processes import Processes
from tests.support.running import REPO
from tinker_atropos.logs import route_mujoco_warnings
from tinker_atropos.state.embedded import EmbeddedValkey


@pytest.fixture(autouse=True)
def _no_sdk_session_outlives_its_test() -> Iterator[None]:
    """The tinker SDK finishes a session only when told to: a client a test (or the cookbook under it) left open goes
    on heart-beating a server long stopped, and after five minutes its warnings land in whichever test of the same
    worker runs then. Every client made during a test is closed at its end."""
    clients: list[tinker.ServiceClient] = []
    made = tinker.ServiceClient.__init__

    def recorded(client: tinker.ServiceClient, *args: object, **kwargs: object) -> None:
        made(client, *args, **kwargs)
        clients.append(client)

    with mock.patch.object(tinker.ServiceClient, "__init__", recorded):
        yield
    for client in clients:
        with contextlib.suppress(Exception):  # its server may be gone: the heartbeats stop all the same
            client.close("success").result(timeout=5)


# make test runs on two xdist workers (Makefile), one per core: torch's intra-op threads in a worker
# (SB3 learning in the test process, tensors checked by hand) would only fight the other worker for the cores.
# The examples a test spawns inherit the same limit (services set theirs from the config): a CleanRL loop on
# two spinning OpenMP threads beside the other worker ran 4x slower than on one.
torch.set_num_threads(1)
for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")


# the tests that make MuJoCo envs in this process (test_mujoco_backend.py): MuJoCo's warnings to the log, as the
# services' (``tinker-atropos`` routes them), not into a MUJOCO_LOG.TXT in the repository
route_mujoco_warnings()
MUJOCO_LOG = REPO / "MUJOCO_LOG.TXT"


def _stat(path: Path) -> tuple[int, int] | None:
    """What changes when a file is written (its size, its modification time), None when there is none."""
    with contextlib.suppress(FileNotFoundError):
        found = path.stat()
        return found.st_size, found.st_mtime_ns
    return None


@pytest.fixture(scope="session", autouse=True)
def no_mujoco_log_in_the_repository() -> Iterator[None]:
    """A test, or a process it started, that leaves MuJoCo's MUJOCO_LOG.TXT in the repository (MuJoCo writes its
    warnings to one in the working directory unless ``logs.route_mujoco_warnings`` routed them) fails the run."""
    before = _stat(MUJOCO_LOG)
    yield
    assert _stat(MUJOCO_LOG) == before, (
        f"{MUJOCO_LOG} was written during the tests: a process that imports MuJoCo without "
        "tinker_atropos.logs.route_mujoco_warnings() (or run in the repository)"
    )


@pytest.fixture(scope="session", autouse=True)
def temporary_folders_under_pytests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Libraries that make temporary folders of their own and leave them (SB3's logger, wandb's media staging)
    make them under pytest's base folder, which pytest prunes, not in the machine's /tmp: in this process
    (``tempfile.tempdir``) and in every process a test starts (``TMPDIR``)."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = folder, folder
    yield
    tempfile.tempdir = before[0]
    if before[1] is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before[1]


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture
def redis_client(valkey: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(valkey.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()
