"""Shared fixtures: a real Valkey server per test module and the service processes a test starts (their helpers
are in tests/support/processes.py)."""

from __future__ import annotations

import contextlib
import itertools
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

# The longest tests, in seconds of make test on the 2-core machine (2026-12-07), by node id prefix. Under xdist's
# worksteal each worker starts on a contiguous share of the collection and steals from the tail of another's: these
# start first, at the head of each share and balanced between them, so that no worker ends the run alone with
# one of them. A test missing here (renamed, new) only loses its place, never its run.
LONGEST_S = {
    "tests/services/test_llm_rl_bench.py::test_two_steps_of_each_path_write_the_reward_curve_and_the_step_split[c": 88,
    "tests/services/test_llm_rl_bench.py::test_two_steps_of_each_path_write_the_reward_curve_and_the_step_split[t": 84,
    "tests/services/test_atropos_smollm2.py::test_the_shipped_config": 59,
    "tests/services/test_full_disk.py::test_a_full_then_read_only": 57,
    "tests/services/test_readme_snippets.py::test_the_tinker_ppo_loop": 55,
    "tests/services/test_supervision.py::test_each_killed_service_is_restarted": 48,
    "tests/services/test_learners_isolated.py": 41,
    "tests/services/test_atropos_loop.py::test_the_toy_environment_learns": 33,
    "tests/services/test_tinker_hostile.py::test_one_clients_long_sampling": 33,
    "tests/services/test_replay.py::test_appends_resent_over_a_stalled_valkey": 33,
    "tests/services/test_learning.py::test_pendulum_learns_with_sac": 31,
    "tests/services/test_bad_records.py::test_bad_records_are_counted_by_reason": 30,
    "tests/services/test_data_parallel.py::test_a_run_of_two_learners_learns": 29,
    "tests/services/test_tinker_weights_out.py::test_smollm2_lora_leaves": 29,
    "tests/unit/test_export.py::test_export_from_a_run_folder": 27,
    "tests/services/test_tinker_fair_shares.py::test_a_flooding_client": 27,
    "tests/services/test_vector_env.py::test_sb3_ppo_learns": 26,
    "tests/services/test_redis_acl.py::test_each_service_trains": 24,
    "tests/services/test_tinker_abandoned.py": 24,
    "tests/services/test_video.py": 24,
}


def _longest_s(item: pytest.Item) -> int:
    return next((s for prefix, s in LONGEST_S.items() if item.nodeid.startswith(prefix)), 0)


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


@pytest.hookimpl(trylast=True)  # after -m's deselection: the shares are those of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first in each worker's share of the collection, the shares' sums of them balanced."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    shares, left = [], len(items)
    for worker in range(workers):  # as xdist's worksteal deals them: each its part of what is left
        shares.append(left // (workers - worker))
        left -= shares[-1]
    longest = sorted((item for item in items if _longest_s(item)), key=_longest_s, reverse=True)
    heads: list[list[pytest.Item]] = [[] for _ in shares]
    sums = [0] * len(shares)
    for item in longest:
        worker = sums.index(min(sums))
        heads[worker].append(item)
        sums[worker] += _longest_s(item)
    rest = iter([item for item in items if not _longest_s(item)])
    items[:] = [
        item
        for head, share in zip(heads, shares, strict=True)
        for item in [*head, *itertools.islice(rest, max(0, share - len(head)))]
    ] + list(rest)


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
