"""Data-parallel learners (``trainer.learners``) on real processes: two learners, each with its share of a batch,
take the update one learner takes of the whole batch where the two must agree (full-batch steps: the same
normalisers, advantages, annealing and parameters, a target_kl stop decided alike), a lost replica fails the next
update instead of hanging it (a hung one after the timeout), and in a run a killed replica is a trainer restart from which learning goes on,
nothing left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tests.support.processes import wait_for
from tests.support.records import HUMANOID_ACT as ACT
from tests.support.records import HUMANOID_OBS as OBS
from tests.support.records import humanoid_chunks
from tests.support.running import REPO, start_up
from tests.support.running import report_rows as metrics
from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import Learner, LearnerSetup
from tinker_atropos.config import TrainerSection
from tinker_atropos.errors import FatalError
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.trainer import learner_channels, learner_replicas
from tinker_atropos.trainer.learner_channels import LearnerLost
from tinker_atropos.trainer.learner_replicas import Replicas, SharedShares, deal, take_share

pytestmark = pytest.mark.integration


def learner_setup(**appo: object) -> LearnerSetup:
    trainer = TrainerSection.model_validate(
        {"algorithm": "appo", "learners": 2, "model": {"hidden_sizes": [32, 32]}, "appo": appo}
    )
    spaces = gym.spaces.Box(-np.inf, np.inf, (OBS,)), gym.spaces.Box(-0.4, 0.4, (ACT,))
    return LearnerSetup(*spaces, trainer, trainer.hyperparameters, torch.device("cpu"), seed=7)


@pytest.fixture
def two(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Learner, Learner, Replicas]]:
    """A learner alone, and the same learner as rank 0 of two (its replica a process of its own)."""
    setup = learner_setup(**request.param)
    alone = algorithms.algorithm("appo").build(setup)
    together = algorithms.algorithm("appo").build(setup)
    replicas = Replicas(setup, 2, threads=1, folder=tmp_path / "learners")
    try:
        together.core.group = replicas.group
        replicas.load(together.state_dict())
        yield alone, together, replicas
    finally:
        replicas.close()


def learn_together(together: Learner, replicas: Replicas, chunks: list[Trajectory]) -> dict[str, float]:
    return together.learn(replicas.learn(chunks))


def assert_same_parameters(one: Learner, other: Learner) -> None:
    for mine, theirs in zip(one.core.model.parameters(), other.core.model.parameters(), strict=True):
        torch.testing.assert_close(theirs, mine, atol=2e-5, rtol=1e-4)
    for mine, theirs in zip(one.core.model.buffers(), other.core.model.buffers(), strict=True):
        torch.testing.assert_close(theirs, mine, atol=1e-6, rtol=1e-6)  # the normalisers, float64


# One minibatch an epoch: every step is the whole batch's, whoever holds which rows; advantages not standardised
# (a minibatch's own statistics: each learner's share would have its own).
FULL_BATCH = {
    "normalize_advantages": False,
    "num_minibatches": 1,
    "anneal_lr": True,
    "anneal_env_steps": 40_000,
}
SETTINGS = [FULL_BATCH | {"update_epochs": 3}, FULL_BATCH | {"update_epochs": 8, "target_kl": 2e-4}]


@pytest.mark.parametrize("two", SETTINGS, indirect=True, ids=["epochs", "target-kl"])
def test_two_learners_take_the_update_of_one(two: tuple[Learner, Learner, Replicas]) -> None:
    """Five chunks (five runs) dealt 3 + 2 (by env steps: 3,072 and 2,048 rows): the observation and return
    normalisers merged from both shares, V-trace over each learner's runs, the gradient of the whole batch, the
    step size annealed by the whole batch's env steps, and target_kl's stop on the whole batch's figure."""
    alone, together, replicas = two
    chunks = humanoid_chunks(5, seed=0)
    assert [len(share) for share in deal(chunks, 2)] == [3, 2]
    for _ in range(3):
        one = alone.learn(chunks)
        both = learn_together(together, replicas, chunks)
        assert one["epochs"] == both["epochs"] and one["learning_rate"] == both["learning_rate"]
        assert abs(one["policy_loss"] - both["policy_loss"]) < 1e-4 * max(1.0, abs(one["policy_loss"]))
        assert_same_parameters(alone, together)
    if alone.hp.target_kl is not None:
        assert one["epochs"] < alone.hp.update_epochs  # it did stop early
    assert together.env_steps == alone.env_steps == 3 * 5 * 1024


@pytest.mark.parametrize("two", SETTINGS[:1], indirect=True, ids=["epochs"])
def test_a_lost_replica_fails_the_next_update_and_close_leaves_nothing(
    two: tuple[Learner, Learner, Replicas],
) -> None:
    _, together, replicas = two
    (replica,) = replicas.processes
    replica.kill()
    replica.wait()
    with pytest.raises(RuntimeError, match="[Cc]onnection"):
        learn_together(together, replicas, humanoid_chunks(2, seed=1))


@pytest.mark.parametrize("two", SETTINGS[:1], indirect=True, ids=["epochs"])
def test_a_hung_replica_fails_the_update_after_the_timeout(
    two: tuple[Learner, Learner, Replicas], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped replica (SIGSTOP) is an error once rank 0 has waited the timeout (60 s in a run), not a stall."""
    _, together, replicas = two
    monkeypatch.setattr(learner_channels, "TIMEOUT_S", 1.0)
    (replica,) = replicas.processes
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        with pytest.raises(LearnerLost, match="learner replica 1 did not answer within 1 s"):
            learn_together(together, replicas, humanoid_chunks(2, seed=1))
    finally:
        replica.kill()


@pytest.mark.parametrize("two", SETTINGS[:1], indirect=True, ids=["epochs"])
def test_a_batch_too_small_to_share_stops_the_trainer_with_what_to_change(
    two: tuple[Learner, Learner, Replicas],
) -> None:
    _, together, replicas = two
    with pytest.raises(
        FatalError, match="gives one of trainer.learners=2 0 rows.*raise trainer.samples_per_update"
    ):
        replicas.learn(humanoid_chunks(1, seed=6))  # one chunk, two learners
    learn_together(
        together, replicas, humanoid_chunks(2, seed=6)
    )  # nothing was sent: the next batch is learned


def test_a_replica_that_fails_to_start_is_an_error_at_once_not_a_hung_rendezvous(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="learner replica 1 exited with code 1 before joining"):
        # torch refuses 0 threads in the replica, before it joins
        Replicas(learner_setup(), 2, threads=0, folder=tmp_path)


def test_a_batch_is_dealt_in_whole_runs_each_chunk_once() -> None:
    """Chunks that continue one another stay with one learner (their advantages run across them); with fewer runs
    than learners, single chunks."""
    chunks = humanoid_chunks(4, seed=2)
    follow = [
        replace(
            chunks[i],
            observations=np.concatenate(
                [chunks[i - 1].bootstrap_observations[None], chunks[i].observations[1:]]
            ),
        )
        for i in (1, 3)
    ]
    batch = [chunks[0], follow[0], chunks[2], follow[1]]  # two runs of two chunks
    shares = deal(batch, 2)
    assert sorted(map(ids, shares)) == sorted([ids(batch[:2]), ids(batch[2:])])
    single = deal(batch, 3)
    assert sorted(i for share in single for i in ids(share)) == sorted(ids(batch)) and all(single)


def test_a_share_crosses_in_shared_memory_and_a_larger_one_gets_a_larger_segment() -> None:
    shelf, attached = SharedShares(), {}
    try:
        small, large = humanoid_chunks(1, seed=3), humanoid_chunks(3, seed=4)
        name, *_ = first = shelf.put(1, small)
        read = take_share(first, attached)
        np.testing.assert_array_equal(read[0].observations, small[0].observations)
        assert read[0].actions.dtype == small[0].actions.dtype and read[0].policy_version == 0
        second = shelf.put(1, large)  # does not fit: a new segment, the old one unlinked
        assert second[0] != name and not Path(f"/dev/shm/{name}").exists()
        del read
        again = take_share(second, attached)
        np.testing.assert_array_equal(again[2].rewards, large[2].rewards)
        assert list(attached) == [second[0]]  # the replica let the old mapping go
        del again
    finally:
        shelf.close()
        for segment in attached.values():
            segment.close()
    assert not Path(f"/dev/shm/{second[0]}").exists()


def test_a_share_that_does_not_fit_dev_shm_stops_the_trainer_with_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A container's /dev/shm holds 64 MB unless given more; a segment written past it would kill the trainer
    with SIGBUS, and a restart would meet the same: a FatalError says what to change instead."""
    free = shutil.disk_usage("/dev/shm")._replace(free=1 << 20)
    monkeypatch.setattr(learner_replicas.shutil, "disk_usage", lambda path: free)
    with pytest.raises(FatalError, match=r"needs 2 MB of /dev/shm, which has 1 MB free.*--shm-size"):
        SharedShares().put(1, humanoid_chunks(1, seed=5))


def ids(chunks: list[Trajectory]) -> list[int]:
    return [id(c) for c in chunks]


def test_learners_are_refused_for_an_algorithm_without_minibatches() -> None:
    with pytest.raises(ValidationError) as refused:
        TrainerSection.model_validate({"algorithm": "sac", "learners": 2})
    assert refused.value.errors()[0]["loc"] == ("learners",)
    assert "split the minibatches of ppo or appo" in str(refused.value)
    with pytest.raises(ValidationError, match="less than or equal to 64"):
        TrainerSection.model_validate({"algorithm": "ppo", "learners": 65})


def replica_pids(run_dir: Path) -> list[int]:
    """The run's learner replicas: children of its trainer."""
    trainer = subprocess.run(
        ["pgrep", "-f", f"tinker_atropos trainer --config {run_dir}"], capture_output=True, text=True
    ).stdout.split()
    found = []
    for parent in trainer:
        children = subprocess.run(
            ["pgrep", "-P", parent, "-f", "tinker_atropos.trainer.learner_replicas"],
            capture_output=True,
            text=True,
        )
        found += [int(pid) for pid in children.stdout.split()]
    return found


def test_a_run_of_two_learners_learns_and_a_killed_replica_is_a_trainer_restart(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = start_up(REPO / "configs" / "pendulum.yaml", run_dir, "--set", "trainer.learners=2")
    try:
        wait_for(lambda: any(r["policy_version"] >= 2 for r in metrics(run_dir)), 90, "two updates")
        (replica,) = wait_for(lambda: replica_pids(run_dir), 10, "the trainer's replica")
        killed_at = metrics(run_dir)[-1]
        os.kill(replica, signal.SIGKILL)
        wait_for(
            lambda: replica_pids(run_dir) not in ([], [replica]), 60, "a new replica, the trainer restarted"
        )
        wait_for(
            lambda: metrics(run_dir)[-1]["policy_version"] > killed_at["policy_version"] + 2,
            90,
            "the policy version to keep rising after the restart",
        )
        versions = [r["policy_version"] for r in metrics(run_dir)]
        assert versions == sorted(versions), f"the policy version went back: {versions}"
        survivors = replica_pids(run_dir)
    finally:
        up.send_signal(signal.SIGINT)
        output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    started = (run_dir / "logs" / "trainer.log").read_text().count("learning data-parallel with 2 learners")
    assert started == 2  # before the kill and after the restart
    assert "  restarts     trainer 1\n" in output, output[-3000:]  # the summary
    alive = [pid for pid in survivors if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"learner replicas left behind: {alive}"
