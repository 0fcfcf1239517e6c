"""The benchmark's output schema on a tiny run, and the latency wrapper its scaling curve relies on."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from rich.console import Console

from bench import delay
from bench.cpu_profile import fold
from bench.learn import LearnOptions, run_learning_benchmark
from bench.phases import (
    GatedMeter,
    IterationGate,
    PhysicsLimit,
    ProcessGroupMeter,
    ServicesMeter,
    Timing,
    last_env_steps,
)
from bench.report import RATE_KEYS
from bench.sf_peer import sf_workers
from bench.throughput import BenchOptions, run_benchmark
from tests.support.running import REPO
from tinker_atropos.config import Config, parse_config
from tinker_atropos.environment.backends.base import BatchSetup
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.environment.check import check_env
from tinker_atropos.environment.envs import env_maker


def pendulum(name: str, rollout: dict, trainer: dict) -> Config:
    """The benchmarks' tests' run: 4 Pendulum instances, ``rollout`` and ``trainer`` sections as given."""
    return parse_config(
        {
            "run": {"name": name},
            "env": {"id": "Pendulum-v1", "instances": 4},
            "rollout": rollout,
            "trainer": trainer,
        }
    )


@pytest.mark.serial
@pytest.mark.integration
def test_a_tiny_benchmark_writes_every_key_and_nulls_the_phases_not_run(tmp_path: Path) -> None:
    # updates often enough to see one in the 2 s figures window
    config = pendulum("bench-test", rollout={"sessions_per_env": 2}, trainer={"samples_per_update": 512})
    options = BenchOptions(
        # every kind of phase once: in-process, local collection, gRPC with every link protected, training (the
        # plain gRPC and secure training phases are the same meters with another transport or environment), and
        # two that cannot run for Pendulum (the physics limit and Sample Factory take MuJoCo envs)
        phases=("limit", "raw", "collect", "collect_grpc_secure", "train", "sample_factory"),
        # 1 s slices and a short run-in before the trainer figures: the keys, not the figures
        timing=Timing(warmup_s=1.0, window_s=2.0, rounds=2, figures_run_in_s=1.0),
        out=tmp_path,
    )

    result = run_benchmark(config, options, Console(quiet=True))

    assert json.loads((tmp_path / "bench.json").read_text()) == result
    assert set(RATE_KEYS) <= result.keys()
    measured = {
        "raw_env_steps_per_s",
        "collect_env_steps_per_s",
        "collect_grpc_secure_env_steps_per_s",  # mutual TLS, token, Redis password, signed records
        "train_env_steps_per_s",
    }
    for key in measured:
        assert result[key] > 0, key
    assert result["collect_secure_env_steps_per_s"] is None and result["collect_grpc_env_steps_per_s"] is None
    assert result["train_secure_env_steps_per_s"] is None
    assert result["raw_backend_steps_per_s"] is None, "the gymnasium backend is raw_env_steps_per_s itself"
    assert result["envpool_steps_per_s"] is None and result["sb3_ppo_steps_per_s"] is None
    assert result["scaling"] is None and result["rollout_scaling"] is None
    assert result["limit_steps_per_s"] is None and result["sample_factory_steps_per_s"] is None
    assert result["unavailable"].keys() == {"limit", "sample_factory"}
    assert "mujoco backend" in result["unavailable"]["limit"]
    assert "no Pendulum-v1" in result["unavailable"]["sample_factory"]
    assert result["ratios"]["collect/raw"] == pytest.approx(
        result["collect_env_steps_per_s"] / result["raw_env_steps_per_s"]
    )
    assert result["ratios"]["collect/collect_grpc"] is None  # a ratio whose phase did not run
    assert result["ratios"]["collect/envpool"] is None and result["ratios"]["train/sb3"] is None
    assert result["ratios"]["train_secure/train"] is None
    # raw, collect and collect_grpc_secure alternate in 2 rounds, each round giving every ratio once more; train,
    # whose group has no SB3 here, runs its 2 slices too
    rounds = result["rounds"]
    assert rounds["steps_per_s"].keys() == measured
    assert all(len(rates) == 2 for rates in rounds["steps_per_s"].values())
    # collection never stops; training pauses its rollouts while it updates (flow_control: pause), so a 1 s slice
    # of it on a loaded machine may hold no step at all
    assert all(min(rates) > 0 for key, rates in rounds["steps_per_s"].items() if not key.startswith("train"))
    assert max(rounds["steps_per_s"]["train_env_steps_per_s"]) > 0
    raw, collect = (
        rounds["steps_per_s"]["raw_env_steps_per_s"],
        rounds["steps_per_s"]["collect_env_steps_per_s"],
    )
    spread = rounds["ratios"]["collect/raw"]
    assert (spread["min"], spread["max"]) == pytest.approx(
        sorted(c / r for c, r in zip(collect, raw, strict=True))
    )
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert rounds["ratios"]["train/sb3"] is None, "no SB3 to compare with"
    train = result["train"]
    assert 0.0 < train["trainer_busy"] <= 1.0
    assert train["policy_lag"]["min"] <= train["policy_lag"]["mean"] <= train["policy_lag"]["max"]
    assert train["unpaused_env_steps_per_s"] > 0
    assert train["policy_versions"][1] > train["policy_versions"][0], "it learned in the figures window"
    cpu = train["cpu_seconds_per_service"]
    assert cpu.keys() == {"env-0", "rollout-0", "trainer"} and min(cpu.values()) > 0
    per_step = train["cpu_us_per_env_step"]
    assert per_step.keys() == cpu.keys() and min(per_step.values()) > 0
    assert train["rollout_cpu_spread"] is None and train["gpu"] is None  # one rollout; the trainer on the CPU
    conditions = result["conditions"]
    assert (conditions["env_id"], conditions["instances"]) == ("Pendulum-v1", 4)
    assert (conditions["warmup_s"], conditions["window_s"], conditions["rounds"]) == (1.0, 2.0, 2)
    assert conditions["slice_s"] == 1.0
    assert conditions["transport"] == "auto" and conditions["rollout_replicas"] == 1
    assert "5 physics steps" in conditions["step_convention"] and "shared" in conditions["note"]
    assert result["machine"]["cores"] >= 1 and result["machine"]["cpu_model"]
    assert result["packages"]["gymnasium"] == gym.__version__
    assert not list(tmp_path.glob("bench-*")), "scratch folder left behind"


@pytest.mark.serial
@pytest.mark.integration
def test_the_learning_benchmark_reports_curves_and_final_returns_under_the_budget(tmp_path: Path) -> None:
    config = pendulum("bench-learn-test", rollout={"chunk_length": 32}, trainer={"samples_per_update": 256})
    # episodes end in its last tenth; SB3's run is the same code path for another curve, not run here
    options = LearnOptions(
        budget_s=16.0, seeds=1, out=tmp_path, report_interval_s=2.0, systems=("tinker_atropos",)
    )

    result = run_learning_benchmark(config, options, Console(quiet=True))

    assert json.loads((tmp_path / "bench-learn.json").read_text()) == result
    chart = tmp_path / "bench-learn.png"
    assert chart.exists() == (importlib.util.find_spec("matplotlib") is not None)  # the bench extra draws it
    ours = result["runs"]["tinker_atropos"]
    assert [run["seed"] for run in ours] == [config.run.seed]
    curve = ours[0]["curve"]
    assert curve[-1]["wall_time_s"] >= options.budget_s, "stopped before the budget was spent"
    assert curve[-1]["wall_time_s"] < options.budget_s + 3 * options.report_interval_s
    assert [p["env_steps"] for p in curve] == sorted(p["env_steps"] for p in curve) and curve[-1][
        "env_steps"
    ] > 0
    tail = [p["episode_return_mean"] for p in curve if p["wall_time_s"] >= 0.9 * options.budget_s]
    assert ours[0]["final_return"] == pytest.approx(np.mean(tail))
    assert ours[0]["last_return"] == curve[-1]["episode_return_mean"] < 0  # Pendulum returns are negative
    assert result["summary"]["tinker_atropos"]["seeds"] == 1
    assert result["runs"].keys() == {"tinker_atropos"} and result["peer"] is None
    assert result["return_difference"] is None and result["errors"] == {}
    assert result["conditions"]["return_window_episodes"] == 10
    assert not list(tmp_path.glob("bench-learn-*")), "scratch folder left behind"


def test_an_unknown_phase_is_refused_with_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed: limit, raw, envpool"):
        BenchOptions(phases=("raw", "warp"), timing=Timing(1.0, 1.0), out=tmp_path)


def test_the_delayed_env_is_served_through_the_module_class_form_of_env_id() -> None:
    env = parse_config(
        {"env": {"id": delay.ENV_ID, "kwargs": {"env_id": "Pendulum-v1", "delay_s": 0.001}}}
    ).env
    assert check_env(env).observation_space.shape == (3,)


def test_a_delayed_step_sleeps_at_least_the_delay_and_returns_what_the_wrapped_env_returns() -> None:
    delayed = env_maker(delay.ENV_ID)(env_id="Pendulum-v1", delay_s=0.05)
    plain = gym.make("Pendulum-v1")
    try:
        obs_d, _ = delayed.reset(seed=3)
        obs_p, _ = plain.reset(seed=3)
        np.testing.assert_array_equal(obs_d, obs_p)
        for action in ([0.5], [-1.5], [2.0]):
            start = time.monotonic()
            got = delayed.step(np.array(action, dtype=np.float32))
            assert time.monotonic() - start >= 0.05
            want = plain.step(np.array(action, dtype=np.float32))
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:4] == want[1:4]
    finally:
        delayed.close()
        plain.close()


def test_the_latency_is_paid_once_per_batch_step_not_once_per_instance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(delay.time, "sleep", sleeps.append)
    batch = GymnasiumBatch(BatchSetup(delay.ENV_ID, {"env_id": "Pendulum-v1", "delay_s": 0.002}, 4))
    try:
        batch.reset(seed=1)
        for _ in range(3):
            batch.step(np.zeros((4, 1), dtype=np.float32))
    finally:
        batch.close()
    assert sleeps == [0.002] * 3


def test_slow_acting_holds_the_process_one_batch_at_a_time_and_acts_as_the_mlp_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rollout-scaling curve's policy: two sessions of one rollout acting at once wait for each other."""
    import torch

    from bench import slow_acting
    from tinker_atropos.config import ModelSection
    from tinker_atropos.models.acting import InferencePolicy
    from tinker_atropos.models.mlp import ActorCritic, mlp_spec
    from tinker_atropos.models.networks import build_network

    monkeypatch.setenv(slow_acting.DELAY_VARIABLE, "0.05")
    section = ModelSection(hidden_sizes=[8], network=slow_acting.NETWORK)
    spec = mlp_spec(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-2, 2, (1,)), section, True, True)
    model = build_network(spec)
    assert isinstance(model, slow_acting.SlowActingMLP)
    policy = InferencePolicy.of_model(model, library="torch")
    obs = np.zeros((4, 3), np.float32)
    threads = [threading.Thread(target=policy.act, args=(obs,)) for _ in range(2)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - start >= 0.1, "the second batch waited for the first"
    plain = ActorCritic(spec | {"network": "mlp"})
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.normalize_obs(torch.ones(2, 3)), plain.normalize_obs(torch.ones(2, 3)))


def test_a_services_meter_takes_the_rate_between_the_counters_moves_not_the_window_edges() -> None:
    """A counter moving 1,000 steps every 0.2 s: 5,000 steps/s, though a 1.1 s window holds 5 or 6 moves
    (counting from the window's edges would say 4,500 or 5,500)."""
    start = time.monotonic()
    meter = ServicesMeter([], lambda: 1000 * int((time.monotonic() - start) / 0.2))

    steps, seconds = meter.count(settle_s=0.05, window_s=1.1)

    assert steps % 1000 == 0 and steps >= 3000
    assert steps / seconds == pytest.approx(5_000, rel=0.1)


def test_a_services_meter_falls_back_to_the_window_when_the_counter_moves_less_than_twice() -> None:
    meter = ServicesMeter([], lambda: 0)

    steps, seconds = meter.count(settle_s=0.0, window_s=0.05)

    assert steps == 0 and seconds >= 0.05


def test_a_gated_learner_counts_whole_iterations_and_waits_between_slices() -> None:
    """A learner doing 100 steps per 0.05 s iteration: a 0.12 s slice ends at the first boundary past it (3
    iterations, 300 steps, about 0.15 s); between slices it runs no iteration; closing the pipe ends it."""
    conn, child_conn = multiprocessing.Pipe()
    gate, steps, boundaries = IterationGate(child_conn), [0], []

    def learner() -> None:
        try:
            while True:
                boundaries.append(time.monotonic())
                gate.boundary(steps[0])
                time.sleep(0.05)
                steps[0] += 100
        except EOFError:
            pass

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    try:
        meter = GatedMeter(conn, warmup_s=0.05)  # the warm-up: a slice whose result is dropped
        idle_since = time.monotonic()
        time.sleep(0.3)
        stepped_while_idle = [t for t in boundaries if t > idle_since]

        counted, seconds = meter.count(settle_s=1.0, window_s=0.12)
    finally:
        conn.close()
    assert counted == 300 and 0.12 <= seconds < 0.5
    assert not stepped_while_idle, "it stepped between slices"
    thread.join(timeout=5)
    assert not thread.is_alive(), "the learner outlived the closed pipe"


def test_a_gated_learner_that_died_is_reported_not_waited_for() -> None:
    conn, child_conn = multiprocessing.Pipe()
    child_conn.close()  # the learner's process is gone

    with pytest.raises(RuntimeError, match="process ended"):
        GatedMeter(conn, warmup_s=0.05)


def test_sample_factory_gets_one_worker_per_core_and_an_even_count_per_worker() -> None:
    assert sf_workers(16, 2) == (2, 8)
    assert sf_workers(16, 16) == (8, 2)  # 16 workers would hold one env each, which its split cannot halve
    assert sf_workers(4, 3) == (2, 2)
    with pytest.raises(ValueError, match="even instance count per worker"):
        sf_workers(3, 2)


def test_the_learning_benchmark_refuses_an_unknown_system_and_a_bad_second_config_before_running(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"unknown systems \['sb3_dqn'\]; allowed: .*tinker_atropos@CONFIG"):
        LearnOptions(budget_s=60, seeds=1, out=tmp_path, systems=("tinker_atropos", "sb3_dqn"))
    with pytest.raises(ValueError, match="cannot read config"):
        LearnOptions(
            budget_s=60, seeds=1, out=tmp_path, systems=(f"tinker_atropos@{tmp_path / 'none.yaml'}",)
        )
    (tmp_path / "bad.yaml").write_text("trainer:\n  algorithm: dqn\n")
    with pytest.raises(ValueError, match="trainer.algorithm"):
        LearnOptions(budget_s=60, seeds=1, out=tmp_path, systems=(f"tinker_atropos@{tmp_path / 'bad.yaml'}",))
    options = LearnOptions(
        budget_s=60, seeds=1, out=tmp_path, systems=("tinker_atropos", "tinker_atropos@configs/humanoid.yaml")
    )
    assert options.systems == ("tinker_atropos", "tinker_atropos@configs/humanoid.yaml")


def test_the_physics_limit_restarts_every_ended_episode_and_counts_the_steps_it_made() -> None:
    """Humanoids under random actions fall within a few dozen steps: after every mujoco.rollout call each
    instance stands in the env's healthy range again (1 < z < 2), and the episodes that ended are counted."""
    limit = PhysicsLimit("Humanoid-v5", {}, num_instances=4, num_threads=2, seed=0)
    try:
        steps = [limit.step() for _ in range(40)]  # 160 env steps each, several falls
        assert steps == [4 * 4] * 40  # 4 instances x 4 env steps per call
        z = limit.qpos[:, 2]
        assert np.all((z > 1.0) & (z < 2.0)), z
        assert limit.episodes >= 4
    finally:
        limit.close()


def test_the_physics_limit_ends_episodes_at_the_time_limit() -> None:
    limit = PhysicsLimit("Humanoid-v5", {"max_episode_steps": 8}, num_instances=3, num_threads=1, seed=0)
    try:
        limit.step()
        assert limit.episodes == 0  # 4 steps: no humanoid falls that fast, none reached the limit
        limit.step()
        assert limit.episodes == 3  # 8 steps: every one truncated and restarted
    finally:
        limit.close()


def test_the_physics_limit_is_refused_for_an_env_the_mujoco_backend_lacks() -> None:
    with pytest.raises(ValueError, match="does not implement 'Pendulum-v1'"):
        PhysicsLimit("Pendulum-v1", {}, num_instances=2, num_threads=1, seed=0)


def test_a_process_group_meter_stops_the_whole_group_between_slices(tmp_path: Path) -> None:
    """A peer whose child appends a JSON line with its env steps every 20 ms, as Sample Factory's reports: the
    meter counts it from report to report over a slice, and between slices the whole group (child included) is
    stopped."""
    curve = tmp_path / "curve.jsonl"
    child = (
        "import json, sys, time\n"
        f"steps = 0\nwhile True:\n    steps += 100\n"
        f"    open({str(curve)!r}, 'a').write(json.dumps({{'env_steps': steps}}) + '\\n')\n    time.sleep(0.02)\n"
    )
    peer = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
        start_new_session=True,
    )
    meter = ProcessGroupMeter(peer.pid, lambda: last_env_steps(curve))
    try:
        wait_until_moves = time.monotonic() + 30
        while last_env_steps(curve) == 0 and time.monotonic() < wait_until_moves:
            time.sleep(0.05)
        meter.pause()
        steps, seconds = meter.count(settle_s=0.1, window_s=1.0)
        assert steps >= 100 and seconds >= 1.0  # from one report to the first a whole window later
        paused_at = last_env_steps(curve)
        time.sleep(0.5)
        assert last_env_steps(curve) == paused_at, "the child kept running while the group was stopped"
    finally:
        meter.resume()
        meter.send(signal.SIGKILL)
        peer.wait()


def test_a_profile_charges_each_sample_to_our_innermost_line_and_sets_waiting_apart() -> None:
    """py-spy's collapsed stacks (outermost first, then the sample count): samples are charged to the innermost
    line of our code, read from the source; a line that blocks on another process (the rollout's select on its
    env stream) is waiting, and the shares are of the rest; a location under 2 % is only counted in ``other``."""
    ours = REPO / "tinker_atropos"
    select_line = next(
        n
        for n, text in enumerate((ours / "environment" / "streams.py").read_text().splitlines(), 1)
        if "select.select(" in text
    )
    raw = "\n".join(
        [
            f"<module> (run.py:1);serve ({ours}/environment/service.py:40);step ({ours}/environment/backends/mujoco_batch.py:66) 600",
            f"<module> (run.py:1);send ({ours}/protocol/local_stream.py:10) 290",
            f"<module> (run.py:1);serve ({ours}/environment/service.py:41) 15",
            "_bootstrap (threading.py:1);run (threading.py:2) 80",
            f"<module> (run.py:1);answer ({ours}/environment/streams.py:{select_line}) 1000",
            f"<module> (run.py:1);tiny ({ours}/runtime.py:9) 15",
        ]
    )

    folded = fold(raw)

    assert folded["samples"] == 2000 and folded["waiting"] == 0.5
    lines = {name.split("  ")[0]: share for name, share in folded["shares"].items()}
    assert lines == {
        "environment/backends/mujoco_batch.py:66": 0.6,
        "protocol/local_stream.py:10": 0.29,
        "(outside our code) threading.py:2": 0.08,
    }
    assert folded["other"] == pytest.approx(0.03)  # service.py:41 and runtime.py:9, 1.5 % each
