"""Shared fixtures: a real Valkey server per test module and the service processes a test starts (their helpers
are in tests/support/processes.py)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from tests.support.processes import Processes
from tinker_atropos.state.embedded import EmbeddedValkey

# make test runs on two xdist workers (Makefile), one per core: torch's intra-op threads in a worker
# (SB3 learning in the test process, tensors checked by hand) would only fight the other worker for the cores.
# The examples a test spawns inherit the same limit (services set theirs from the config): a CleanRL loop on
# two spinning OpenMP threads beside the other worker ran 4x slower than on one.
torch.set_num_threads(1)
for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")


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
