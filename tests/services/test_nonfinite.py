"""Non-finite values never propagate: an env that returns NaNs, updates that overflow, NaN weights in Redis."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from tests.support.asserts import assert_same
from tests.support.envs import pendulum_env
from tests.support.processes import Processes, wait_for
from tests.support.records import serialized_chunk
from tests.support.running import Sidecar, config_file, report_rows, run_up_with
from tinker_atropos.config import parse_config
from tinker_atropos.models.mlp import ActorCritic, mlp_spec
from tinker_atropos.models.weight_bytes import weights_from_bytes, weights_to_bytes
from tinker_atropos.protocol.trajectory import decode_trajectory
from tinker_atropos.rollout.policy import PolicySource
from tinker_atropos.state.checkpoint_files import load_latest_checkpoint
from tinker_atropos.state.experience import ExperienceWriter
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, published_version
from tinker_atropos.trainer.experience_loop import ExperienceLoop

pytestmark = pytest.mark.integration


class WeightsWatcher(Sidecar):
    """Reads the published weights every 0.2 s and records each version and whether it loaded."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        super().__init__(interval_s=0.2)
        self.client, self.run_name = client, run
        self.versions: dict[int, str] = {}  # version -> "finite" or the error

    def work(self) -> None:
        published = fetch_weights(self.client, self.run_name)
        if published is not None and published.version not in self.versions:
            try:
                weights_from_bytes(published.blob)
                self.versions[published.version] = "finite"
            except ValueError as error:
                self.versions[published.version] = str(error)


def test_an_env_that_returns_nans_runs_to_its_budget_with_finite_weights_throughout(
    tmp_path: Path, valkey, redis_client: redis.Redis
) -> None:
    kwargs = {"nan_reward_every": 150, "nan_obs_every": 230, "max_episode_steps": 200}
    config = config_file(
        tmp_path, run={"name": "nan-env"}, env={"id": "tests.support.envs:NaNPendulum", "kwargs": kwargs}
    )
    run_dir = tmp_path / "run"
    watcher = WeightsWatcher(redis_client, "nan-env")
    output = run_up_with(
        watcher, config, run_dir, "--redis-url", valkey.url, "--total-steps", "20000", timeout=300
    )

    last = report_rows(run_dir)[-1]
    assert last["env_steps"] >= 20000
    assert last["counters"]["episodes_cut_nonfinite"] > 20, last  # ~25 NaNs per instance over the run
    cut = last["counters"]["episodes_cut_nonfinite"]
    problems = next(line for line in output.splitlines() if line.startswith("  problems     "))  # the summary
    assert f"episodes_cut_nonfinite {cut:,}" in problems, problems
    assert len(watcher.versions) >= 3 and set(watcher.versions.values()) == {"finite"}, watcher.versions
    assert not any(k.startswith("records_rejected_") for k in last["counters"]), last["counters"]
    env_log, trainer_log = ((run_dir / "logs" / f"{n}.log").read_text() for n in ("env-0", "trainer"))
    assert "episodes cut and reset: the env returned NaN or infinity (session " in env_log
    assert "update undone" not in trainer_log
    for log in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def test_updates_that_overflow_are_undone_and_a_diverging_trainer_stops_with_an_error(
    tmp_path: Path, valkey, redis_client: redis.Redis, processes: Processes
) -> None:
    """Rewards of 3e38 are finite but their returns overflow float32: each such update is undone, the version
    does not move, and two in a row (trainer.max_nonfinite_updates) stop the trainer with exit code 2."""
    run = "diverge"
    trainer_config = {"samples_per_update": 16, "max_nonfinite_updates": 2}
    config = config_file(tmp_path, run={"name": run}, env={"instances": 2}, trainer=trainer_config)
    common = ["--config", str(config), "--redis-url", valkey.url, "--port", "0"]
    processes.start("env", *common, name="env")  # the trainer reads the spaces from a live env service
    trainer = processes.start("trainer", *common, "--run-dir", str(tmp_path / "run"), name="trainer")
    writer = ExperienceWriter(redis_client, run, max_queued_chunks=64)
    version = lambda: published_version(redis_client, run)  # noqa: E731

    def discarded() -> int:
        trainers = live_services(redis_client, run, "trainer")
        return trainers[0].figures["updates_discarded_nonfinite"] if trainers else 0

    wait_for(lambda: version() == 0, 60, "the trainer's first weights")
    writer.append(serialized_chunk(2, seed=1, version=0), env_steps=16)
    wait_for(lambda: version() == 1, 30, "an update on a sound chunk")
    writer.append(serialized_chunk(2, seed=2, version=1, reward_fill=3e38), env_steps=16)
    wait_for(lambda: discarded() == 1, 30, "the overflowing update to be undone")
    assert version() == 1
    writer.append(serialized_chunk(2, seed=3, version=1), env_steps=16)
    wait_for(lambda: version() == 2, 30, "learning to go on")
    for seed in (4, 5):
        writer.append(serialized_chunk(2, seed=seed, version=2, reward_fill=3e38), env_steps=16)
    assert trainer.wait(timeout=30) == 2

    log = processes.log("trainer")
    assert "error: 2 updates in a row came out NaN or infinite" in log.splitlines()[-1], log[-2000:]
    assert log.count("update undone: NaN or infinity in") == 3 and "Traceback" not in log
    assert version() == 2
    weights_from_bytes(fetch_weights(redis_client, run).blob)  # finite, or this raises
    _, state = load_latest_checkpoint(tmp_path / "run" / "checkpoints")
    model = state["learner"]["core"]["model"]
    assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())
    assert state["learner"]["core"]["version"] == 2


def nan_weights(seed: int) -> tuple[bytes, dict]:
    trainer = parse_config({"trainer": {"model": {"hidden_sizes": [8]}}}).trainer
    env = pendulum_env()
    spec = mlp_spec(env.observation_space, env.action_space, trainer.model, True, True)
    torch.manual_seed(seed)
    model = ActorCritic(spec)
    with torch.no_grad():
        model.actor[0].weight[0, 0] = float("nan")
    return weights_to_bytes(model), spec


def test_nan_weights_in_redis_are_never_adopted(tmp_path: Path, redis_client: redis.Redis) -> None:
    blob, spec = nan_weights(0)
    publish_weights(redis_client, "poisoned", 41, blob, spec)
    config = parse_config({"run": {"name": "poisoned"}, "trainer": {"model": {"hidden_sizes": [8]}}})
    trainer = ExperienceLoop(config, redis_client, tmp_path)
    trainer.setup(pendulum_env())  # a trainer restarting next to the poisoned weights
    assert trainer.version == 42 and published_version(redis_client, "poisoned") == 42
    weights_from_bytes(fetch_weights(redis_client, "poisoned").blob)  # its own, finite

    policies = PolicySource(redis_client, "poisoned", torch.device("cpu"))
    assert policies.refresh().version == 42
    publish_weights(redis_client, "poisoned", 43, blob, spec)
    for _ in range(3):  # refused once, and not fetched again on every chunk
        assert policies.refresh().version == 42
    assert policies.rejected == 1
    actions, _, _ = policies.refresh().act(np.zeros((2, 3), np.float32))
    assert np.isfinite(actions).all()


class AnnouncedLock:
    """A lock that says when a thread starts waiting for it."""

    def __init__(self) -> None:
        self.lock, self.waiting = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *_: object) -> None:
        self.lock.release()


def test_a_session_that_read_a_version_before_another_loaded_a_newer_one_refuses_nothing(
    redis_client: redis.Redis,
) -> None:
    """Sessions refresh concurrently: one reads version 2, another loads 3 meanwhile; the first must not take
    its own stale read for a record written back over version 3 (it counted ``rolled_back`` before)."""
    model = ActorCritic(
        spec := mlp_spec(
            pendulum_env().observation_space,
            pendulum_env().action_space,
            parse_config({}).trainer.model,
            True,
            True,
        )
    )
    publish_weights(redis_client, "racing", 1, weights_to_bytes(model), spec)
    policies = PolicySource(redis_client, "racing", torch.device("cpu"))
    assert policies.refresh().version == 1
    publish_weights(redis_client, "racing", 2, weights_to_bytes(model), spec)
    policies._lock = lock = AnnouncedLock()
    with lock:  # the other session holds the lock, loading version 3
        first = ThreadPoolExecutor(1).submit(policies.refresh)  # reads version 2, then waits
        assert lock.waiting.wait(10)
        publish_weights(redis_client, "racing", 3, weights_to_bytes(model), spec)
        policies._current = policies._load(3)
    assert first.result(10).version == 3 and policies.rejected == 0, policies.refused


def test_an_undone_update_restores_the_parameters_and_optimizer_exactly(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    config = parse_config({"run": {"name": "undo"}, "trainer": {"samples_per_update": 16}})
    trainer = ExperienceLoop(config, redis_client, tmp_path)
    trainer.setup(pendulum_env())
    # optimizer moments exist
    assert trainer.updater.learn([decode_trajectory(serialized_chunk(2, seed=6), trainer.spec)]) is not None
    before = copy.deepcopy(trainer.learner.state_dict())

    poisoned = decode_trajectory(serialized_chunk(2, seed=7, reward_fill=3e38), trainer.spec)
    assert trainer.updater.learn([poisoned]) is None

    assert_same(trainer.learner.state_dict(), before)
    assert trainer.updater.guard.in_a_row == 1 and trainer.status().updates_discarded_nonfinite == 1
