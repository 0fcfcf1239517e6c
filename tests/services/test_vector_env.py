"""``RemoteVectorEnv`` and ``RemoteSB3VecEnv`` over real env service processes: step for step what Gymnasium's own
``SyncVectorEnv`` returns (SAME_STEP autoreset, final observations, episode statistics), seeded resets, instances
freed on close, a lost service as an error, and Stable-Baselines3 learning through it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode

from tests.support.processes import Processes, stop_process, wait_for
from tests.support.reach_env import Reach
from tests.support.running import REPO, config_file
from tinker_atropos import RemoteSB3VecEnv, RemoteVectorEnv
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.environment.vector_env import EnvServiceLost
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration


def serve_envs(
    tmp_path: Path,
    processes: Processes,
    url: str,
    redis_client,
    run: str,
    env_id: str,
    services: int,
    instances: int,
) -> list[str]:
    """``services`` env service processes of ``instances`` each, registered under ``run``; their addresses."""
    config = config_file(tmp_path, run={"name": run}, env={"id": env_id, "instances": instances})
    for i in range(services):
        processes.start("env", "--config", str(config), "--redis-url", url, "--port", "0", name=f"env-{i}")
    found = wait_for(
        lambda: (
            len(live_services(redis_client, run, "env")) == services
            and live_services(redis_client, run, "env")
        ),
        60,
        f"{services} env services",
    )
    return sorted(service.address for service in found)


def assert_close(ours: object, theirs: object) -> None:
    """Equal up to float32 rounding (what travels on the wire), entry by entry for a Dict observation."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (ours, theirs)
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype, key
            assert_close(ours[key], value)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def assert_same_step(ours: tuple, theirs: tuple, stats_key: str = "episode") -> None:
    """One step of RemoteVectorEnv against SyncVectorEnv (with RecordEpisodeStatistics): float32 on the wire."""
    (obs, rewards, terminated, truncated, infos), (obs_g, rewards_g, terminated_g, truncated_g, infos_g) = (
        ours,
        theirs,
    )
    assert_close(obs, obs_g)
    np.testing.assert_allclose(rewards, rewards_g, rtol=1e-5, atol=1e-5)
    assert rewards.dtype == rewards_g.dtype
    np.testing.assert_array_equal(terminated, terminated_g)
    np.testing.assert_array_equal(truncated, truncated_g)
    assert sorted(infos) == sorted(infos_g), (sorted(infos), sorted(infos_g))
    if "final_obs" in infos:
        np.testing.assert_array_equal(infos["_final_obs"], infos_g["_final_obs"])
        for i in np.flatnonzero(infos["_final_obs"]):
            assert_close(infos["final_obs"][i], infos_g["final_obs"][i])
        assert data_equivalence(infos["final_info"], infos_g["final_info"])
        np.testing.assert_array_equal(infos[f"_{stats_key}"], infos_g[f"_{stats_key}"])
        np.testing.assert_allclose(infos[stats_key]["r"], infos_g[stats_key]["r"], rtol=1e-4)
        np.testing.assert_array_equal(infos[stats_key]["l"], infos_g[stats_key]["l"])


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_two_env_services_step_as_gymnasiums_own_vector_env(
    tmp_path: Path, valkey, redis_client, processes: Processes, transport: str
) -> None:
    """Pendulum's time limit (200 steps) ends every episode inside the 230 steps: final observations and episode
    statistics must match Gymnasium's, instance for instance, across the two services."""
    serve_envs(tmp_path, processes, valkey.url, redis_client, "vec", "Pendulum-v1", services=2, instances=2)
    ours = RemoteVectorEnv(run="vec", redis_url=valkey.url, transport=transport)
    theirs = gym.wrappers.vector.RecordEpisodeStatistics(
        gym.vector.SyncVectorEnv(
            [lambda: gym.make("Pendulum-v1")] * 4, autoreset_mode=AutoresetMode.SAME_STEP
        )
    )
    try:
        assert ours.num_envs == 4 and ours.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
        assert ours.single_observation_space == theirs.single_observation_space
        assert ours.action_space == theirs.action_space
        obs, info = ours.reset(seed=11)
        obs_g, _ = theirs.reset(seed=11)
        np.testing.assert_allclose(obs, obs_g, rtol=1e-6, atol=1e-6)
        assert obs in ours.observation_space and info == {}
        actions = np.random.default_rng(0).uniform(-2, 2, (230, 4, 1)).astype(np.float32)
        ended = 0
        for step_actions in actions:
            step, step_g = ours.step(step_actions), theirs.step(step_actions)
            assert_same_step(step, step_g)
            ended += int(step[3].sum())
        assert ended == 4
    finally:
        ours.close()
        theirs.close()


def test_dict_observations_come_back_as_the_envs_dict(
    tmp_path: Path, valkey, redis_client, processes
) -> None:
    serve_envs(tmp_path, processes, valkey.url, redis_client, "reach", "tests.support.reach_env:Reach", 1, 3)
    ours = RemoteVectorEnv(run="reach", redis_url=valkey.url, stats_key="stats")
    theirs = gym.wrappers.vector.RecordEpisodeStatistics(
        gym.vector.SyncVectorEnv([Reach] * 3, autoreset_mode=AutoresetMode.SAME_STEP), stats_key="stats"
    )
    try:
        assert ours.single_observation_space == theirs.single_observation_space
        obs, _ = ours.reset(seed=5)
        assert_close(obs, theirs.reset(seed=5)[0])  # entries in their own dtypes: the view is uint8
        assert obs in ours.observation_space
        for step_actions in np.random.default_rng(1).uniform(-1, 1, (45, 3, 2)).astype(np.float32):
            assert_same_step(ours.step(step_actions), theirs.step(step_actions), stats_key="stats")
    finally:
        ours.close()
        theirs.close()


def test_seeded_resets_repeat_and_close_frees_the_instances(
    tmp_path: Path, valkey, redis_client, processes
) -> None:
    (address,) = serve_envs(tmp_path, processes, valkey.url, redis_client, "seeds", "Pendulum-v1", 1, 4)
    env = RemoteVectorEnv([address], instances_per_service=3, stats_key=None)
    probe = EnvClient(address)
    try:
        assert env.num_envs == 3 and probe.describe().free_instances == 1
        first, _ = env.reset(seed=7)
        again, _ = env.reset(seed=7)
        other, _ = env.reset(seed=8)
        np.testing.assert_array_equal(first, again)
        np.testing.assert_array_equal(first[1], other[0])  # instance i is seeded with seed + i
        unseeded = [env.reset()[0] for _ in range(2)]  # seeds drawn from the last seed given: repeatable
        env.reset(seed=8)
        np.testing.assert_array_equal(unseeded[1], [env.reset()[0] for _ in range(2)][1])
        assert not np.array_equal(unseeded[0], unseeded[1])
        # RecordEpisodeStatistics needs its key free: stats_key=None leaves it so
        wrapped = gym.wrappers.vector.RecordEpisodeStatistics(gym.wrappers.vector.ClipAction(env))
        wrapped.reset(seed=1)
        for _ in range(200):
            *_, infos = wrapped.step(np.full((3, 1), 5.0, np.float32))
        assert infos["_episode"].all() and (infos["episode"]["l"] == 200).all()
        with pytest.raises(ValueError, match=r"actions must have shape \(3, 1\), got \(2, 1\)"):
            env.step(np.zeros((2, 1), np.float32))
        env.close()
        assert wait_for(lambda: probe.describe().free_instances == 4, 10, "the instances freed")
    finally:
        env.close()
        probe.close()


def test_a_killed_env_service_is_an_error_not_a_hang(tmp_path: Path, valkey, redis_client, processes) -> None:
    serve_envs(tmp_path, processes, valkey.url, redis_client, "lost", "Pendulum-v1", 2, 1)
    env = RemoteVectorEnv(run="lost", redis_url=valkey.url, transport="grpc")
    try:
        env.reset(seed=0)
        env.step(np.zeros((2, 1), np.float32))
        processes.started[1].send_signal(signal.SIGKILL)
        processes.started[1].wait()
        with pytest.raises(EnvServiceLost, match="an env service was lost .*reset\\(\\) opens new sessions"):
            for _ in range(100):
                env.step(np.zeros((2, 1), np.float32))
        with pytest.raises(EnvServiceLost, match="the sessions are closed: call reset"):
            env.step(np.zeros((2, 1), np.float32))
    finally:
        env.close()


def test_a_stopped_env_service_on_this_host_is_an_error_after_the_answer_timeout(
    tmp_path: Path, valkey, redis_client, processes
) -> None:
    """SIGSTOP keeps the local socket open: without a bound the step would wait for SIGCONT."""
    serve_envs(tmp_path, processes, valkey.url, redis_client, "stopped", "Pendulum-v1", 1, 2)
    env = RemoteVectorEnv(run="stopped", redis_url=valkey.url, answer_timeout_s=2.0)  # the local fast path
    service = processes.started[0]
    try:
        env.reset(seed=0)
        stop_process(service.pid)
        started = time.monotonic()
        with pytest.raises(EnvServiceLost, match="DEADLINE_EXCEEDED: the env service did not answer in 2 s"):
            env.step(np.zeros((2, 1), np.float32))
        assert time.monotonic() - started < 10
    finally:
        service.send_signal(signal.SIGCONT)
        env.close()


def test_sb3_ppo_learns_pendulum_through_the_env_services(
    tmp_path: Path, valkey, redis_client, processes
) -> None:
    """SB3's PPO with the RL Zoo's Pendulum hyper-parameters, its environment 4 instances in an env service:
    the mean return of its last episodes (logged by SB3 from the service's episode statistics) must rise from
    random play (about -1,200) past -700 (learning shown in half the steps -400 takes)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    class StopAtTarget(BaseCallback):
        first: list[float] = []

        def _on_step(self) -> bool:
            returns = [episode["r"] for episode in self.model.ep_info_buffer]
            self.first = self.first or returns[:4]
            return len(returns) < 20 or np.mean(returns[-20:]) < -700

    serve_envs(tmp_path, processes, valkey.url, redis_client, "sb3", "Pendulum-v1", 1, 4)
    env = RemoteSB3VecEnv(run="sb3", redis_url=valkey.url)
    try:
        env.seed(3)
        env.reset()
        for _ in range(200):  # SB3's conventions for an episode the time limit ended
            env.step_async(np.zeros((4, 1), np.float32))
            _, rewards, dones, infos = env.step_wait()
        assert (
            dones.all() and rewards.dtype == np.float32 and all(info["TimeLimit.truncated"] for info in infos)
        )
        assert infos[0]["terminal_observation"].shape == (3,) and infos[0]["episode"]["l"] == 200
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=1024,
            gae_lambda=0.95,
            gamma=0.9,
            n_epochs=10,
            ent_coef=0.0,
            learning_rate=1e-3,
            clip_range=0.2,
            use_sde=True,
            sde_sample_freq=4,
            seed=3,
            device="cpu",
        )
        stop = StopAtTarget()
        model.learn(total_timesteps=150_000, callback=stop)
        returns = [episode["r"] for episode in model.ep_info_buffer]
        assert np.mean(stop.first) < -900 and np.mean(returns[-20:]) >= -700, (stop.first, returns)
        assert model.num_timesteps < 150_000
    finally:
        env.close()


def test_the_cleanrl_style_sac_example_runs_its_loop_over_the_env_services(
    tmp_path: Path, valkey, redis_client, processes
) -> None:
    """examples/cleanrl_sac_remote.py, CleanRL's SAC stepping 2 instances of an env service, for 2,000 steps of
    which 1,200 make updates: every episode's return comes back through ``infos["episode"]``. (Learning through
    this seam is shown by SB3's PPO above and by the SAC trainer's own test; this checks the shipped example.)"""
    serve_envs(tmp_path, processes, valkey.url, redis_client, "cleanrl", "Pendulum-v1", 1, 2)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "cleanrl_sac_remote.py"),
            "--run",
            "cleanrl",
            "--redis-url",
            valkey.url,
            "--total-timesteps",
            "2000",
            "--learning-starts",
            "800",
            "--hidden",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    returns = outcome["returns"]
    assert outcome["steps"] == 2000
    assert len(returns) == 10  # 1,000 steps per instance, 200-step episodes
    assert all(-16.3 * 200 <= r <= 0 for r in returns), returns  # Pendulum's reward lies in [-16.27, 0]
