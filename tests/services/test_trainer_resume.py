"""The trainer resumes exactly where its checkpoint left it, with a policy version that only goes up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.asserts import assert_names_nothing_of_the_package, assert_same
from tests.support.envs import pendulum_env
from tests.support.loops import started_loop
from tests.support.records import trajectory_chunk
from tinker_atropos.config import parse_config
from tinker_atropos.state.checkpoint_files import read_checkpoint, save_checkpoint
from tinker_atropos.state.weights import fetch_weights, published_version
from tinker_atropos.trainer.experience_loop import ExperienceLoop


def test_resume_restores_everything_and_keeps_the_version_monotonic(tmp_path: Path, redis_client) -> None:
    config = parse_config({"run": {"name": "resume"}, "trainer": {"checkpoint": {"keep": 2}}})
    first, checkpointer = started_loop(config, redis_client, tmp_path)
    for i in range(3):
        first.losses = first.learner.learn([trajectory_chunk(i, 8, act_dim=1, version=first.version)])
        first.learner.core.version += 1
        first.updates += 1
    checkpointer.save(force=True)
    saved = first.save().state
    # normaliser statistics are part of the state
    assert saved["learner"]["core"]["model"]["obs_rms.count"] > 1

    second, _ = started_loop(config, redis_client, tmp_path)
    assert_same(second.save().state, saved)
    assert second.version == 3 and published_version(redis_client, "resume") == 3

    # both continue identically: same data, same RNG streams, same parameters afterwards
    first.learner.learn([trajectory_chunk(9, 8, act_dim=1, version=3)])
    second.learner.learn([trajectory_chunk(9, 8, act_dim=1, version=3)])
    assert_same(second.learner.core.model.state_dict(), first.learner.core.model.state_dict())


@pytest.mark.parametrize("algorithm", ["ppo", "sac"])
def test_a_checkpoint_holds_plain_data_that_loads_wherever_the_classes_move(
    tmp_path: Path, redis_client, algorithm: str
) -> None:
    config = parse_config({"run": {"name": "plain"}, "trainer": {"algorithm": algorithm}})
    loop, checkpointer = started_loop(config, redis_client, tmp_path)
    loop.learner.learn([trajectory_chunk(1, 8, act_dim=1, version=0)])
    checkpointer.save(force=True)
    [checkpoint] = (tmp_path / "checkpoints").glob("checkpoint-*.pt")
    assert_names_nothing_of_the_package(checkpoint)


def test_a_restart_continues_from_newer_weights_in_redis(tmp_path: Path, redis_client) -> None:
    config = parse_config({"run": {"name": "monotonic"}})
    ahead = ExperienceLoop(config, redis_client, tmp_path / "a")
    ahead.setup(pendulum_env())
    ahead.learner.learn([trajectory_chunk(1, 8, act_dim=1, version=0)])
    ahead.learner.core.version = 41
    ahead.publish()

    fresh = ExperienceLoop(config, redis_client, tmp_path / "b")  # no checkpoint of its own
    fresh.setup(pendulum_env())
    assert fresh.version == 41
    assert_same(fresh.learner.core.model.state_dict(), ahead.learner.core.model.state_dict())
    assert fetch_weights(redis_client, "monotonic").version == 41


def test_version_goes_above_weights_of_another_model(tmp_path: Path, redis_client) -> None:
    other = parse_config({"run": {"name": "other"}, "trainer": {"model": {"hidden_sizes": [8]}}})
    ahead = ExperienceLoop(other, redis_client, tmp_path / "a")
    ahead.setup(pendulum_env())
    ahead.learner.core.version = 41
    ahead.publish()

    fresh = ExperienceLoop(parse_config({"run": {"name": "other"}}), redis_client, tmp_path / "b")
    fresh.setup(pendulum_env())
    assert fresh.version == 42
    assert fetch_weights(redis_client, "other").spec["hidden_sizes"] == [64, 64]


def test_sac_resumes_its_replay_buffer_from_the_journal_beside_small_checkpoints(
    tmp_path: Path, redis_client
) -> None:
    config = parse_config(
        {
            "run": {"name": "sac-resume"},
            "env": {"id": "Pendulum-v1"},
            "trainer": {"algorithm": "sac", "sac": {"learning_starts": 16, "batch_size": 8}},
        }
    )
    first, checkpointer = started_loop(config, redis_client, tmp_path)
    for i in range(3):
        first.learner.learn([trajectory_chunk(i, 8, act_dim=1, version=first.version)])
        first.learner.core.version += 1
        checkpointer.save(force=True)
    replay = first.learner.replay
    # each checkpoint wrote the 16 transitions it had not written, and counts them; none inside the file
    segments = [(start, stop) for start, stop, _ in first.checkpoints.journal.segments()]
    assert segments == [(0, 16), (16, 32), (32, 48)]
    [*_, latest] = sorted((tmp_path / "checkpoints").glob("checkpoint-*.pt"))
    assert read_checkpoint(latest)["replay"] == {"added": 48}

    second, checkpointer = started_loop(config, redis_client, tmp_path)
    assert second.learner.replay.added == 48
    for name, rows in replay.since(0).items():
        np.testing.assert_array_equal(second.learner.replay.since(0)[name], rows, err_msg=name)
    # it goes on numbering from there: its next checkpoint's segment follows the last
    second.learner.learn([trajectory_chunk(7, 8, act_dim=1, version=second.version)])
    checkpointer.save(force=True)
    assert [(a, b) for a, b, _ in second.checkpoints.journal.segments()][-1] == (48, 64)

    # a checkpoint of the earlier format held the transitions: they come back, then journal on
    old = tmp_path / "format-2"
    state = read_checkpoint(latest)
    state["format"], state["replay"] = 2, {n: torch.from_numpy(rows) for n, rows in replay.since(0).items()}
    save_checkpoint(old / "checkpoints", 3, state, keep=1)
    third, _ = started_loop(config, redis_client, old)
    assert third.learner.replay.added == 48
    np.testing.assert_array_equal(third.learner.replay.since(0)["rewards"], replay.since(0)["rewards"])
    assert [(a, b) for a, b, _ in third.checkpoints.journal.segments()] == [(0, 48)]
