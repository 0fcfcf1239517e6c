"""The trainer resumes exactly where its checkpoint left it, with a policy version that only goes up."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from tinker_atropos.config import parse_config
from tinker_atropos.environment.client import EnvDescription
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.state.checkpoints import read_checkpoint, save_checkpoint
from tinker_atropos.state.weights import fetch_weights, published_version
from tinker_atropos.trainer.experience_loop import ExperienceLoop


def pendulum_env() -> EnvDescription:
    """What an env service of Pendulum-v1 describes itself as."""
    env = gym.make("Pendulum-v1")
    return EnvDescription("Pendulum-v1", env.observation_space, env.action_space, 8, 8, "e", "gymnasium", "")


def chunk(seed: int, version: int) -> Trajectory:
    rng = np.random.default_rng(seed)
    t, n = 8, 2
    return Trajectory(
        policy_version=version,
        env_incarnation="e",
        observations=rng.standard_normal((t, n, 3)).astype(np.float32),
        actions=rng.standard_normal((t, n, 1)).astype(np.float32),
        log_probs=rng.standard_normal((t, n)).astype(np.float32),
        values=rng.standard_normal((t, n)).astype(np.float32),
        rewards=rng.standard_normal((t, n)).astype(np.float32),
        terminated=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool),
        truncation_values=np.zeros((t, n), np.float32),
        bootstrap_observations=rng.standard_normal((n, 3)).astype(np.float32),
        truncated_observations=np.zeros((0, 3), np.float32),
        bootstrap_values=np.zeros(n, np.float32),
    )


def assert_same(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


def test_resume_restores_everything_and_keeps_the_version_monotonic(tmp_path: Path, redis_client) -> None:
    config = parse_config({"run": {"name": "resume"}, "trainer": {"checkpoint": {"keep": 2}}})
    first = ExperienceLoop(config, redis_client, tmp_path)
    first.setup(pendulum_env())
    for i in range(3):
        first.losses = first.learner.learn([chunk(i, first.version)])
        first.version += 1
        first.updates += 1
    first.checkpoint()
    saved = first.checkpoint_state()
    assert (
        saved["learner"]["core"]["model"]["obs_rms.count"] > 1
    )  # normaliser statistics are part of the state

    second = ExperienceLoop(config, redis_client, tmp_path)
    second.setup(pendulum_env())
    assert_same(second.checkpoint_state(), saved)
    assert second.version == 3 and published_version(redis_client, "resume") == 3

    # both continue identically: same data, same RNG streams, same parameters afterwards
    first.learner.learn([chunk(9, 3)])
    second.learner.learn([chunk(9, 3)])
    assert_same(second.learner.core.model.state_dict(), first.learner.core.model.state_dict())


def test_a_restart_continues_from_newer_weights_in_redis(tmp_path: Path, redis_client) -> None:
    config = parse_config({"run": {"name": "monotonic"}})
    ahead = ExperienceLoop(config, redis_client, tmp_path / "a")
    ahead.setup(pendulum_env())
    ahead.learner.learn([chunk(1, 0)])
    ahead.version = 41
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
    ahead.version = 41
    ahead.publish()

    fresh = ExperienceLoop(parse_config({"run": {"name": "other"}}), redis_client, tmp_path / "b")
    fresh.setup(pendulum_env())
    assert fresh.version == 42
    assert fetch_weights(redis_client, "other").spec["hidden_sizes"] == [64, 64]


def test_sac_resumes_its_replay_buffer_from_the_journal_beside_small_checkpoints(
    tmp_path: Path, redis_client
) -> None:
    config = parse_config({"run": {"name": "sac-resume"}, "env": {"id": "Pendulum-v1"},
                           "trainer": {"algorithm": "sac", "sac": {"learning_starts": 16, "batch_size": 8}}})  # fmt: skip
    first = ExperienceLoop(config, redis_client, tmp_path)
    first.setup(pendulum_env())
    for i in range(3):
        first.learner.learn([chunk(i, first.version)])
        first.version += 1
        first.checkpoint()
    replay = first.learner.replay
    # each checkpoint wrote the 16 transitions it had not written, and counts them; none inside the file
    segments = [(start, stop) for start, stop, _ in first.journal.segments()]
    assert segments == [(0, 16), (16, 32), (32, 48)]
    [*_, latest] = sorted((tmp_path / "checkpoints").glob("checkpoint-*.pt"))
    assert read_checkpoint(latest)["replay"] == {"added": 48}

    second = ExperienceLoop(config, redis_client, tmp_path)
    second.setup(pendulum_env())
    assert second.learner.replay.added == 48
    for name, rows in replay.since(0).items():
        np.testing.assert_array_equal(second.learner.replay.since(0)[name], rows, err_msg=name)
    # it goes on numbering from there: its next checkpoint's segment follows the last
    second.learner.learn([chunk(7, second.version)])
    second.checkpoint()
    assert [(a, b) for a, b, _ in second.journal.segments()][-1] == (48, 64)

    # a checkpoint of the earlier format held the transitions: they come back, then journal on
    old = tmp_path / "format-2"
    state = read_checkpoint(latest)
    state["format"], state["replay"] = 2, {n: torch.from_numpy(rows) for n, rows in replay.since(0).items()}
    save_checkpoint(old / "checkpoints", 3, state, keep=1)
    third = ExperienceLoop(config, redis_client, old)
    third.setup(pendulum_env())
    assert third.learner.replay.added == 48
    np.testing.assert_array_equal(third.learner.replay.since(0)["rewards"], replay.since(0)["rewards"])
    assert [(a, b) for a, b, _ in third.journal.segments()] == [(0, 48)]
