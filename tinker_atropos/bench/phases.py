"""The benchmark's phases: each measures env steps per second of one way to run the same env and instances.

Every phase runs a warm-up (imports, JIT-free but cache- and allocator-warming first steps, service start-up
excluded) and then counts the env steps of a fixed wall-time window. One env step is one ``env.step`` of one
instance (for MuJoCo locomotion, 5 physics steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import redis
import torch

from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.algorithms.ppo.networks import policy_spec
from tinker_atropos.config import Config, Transport
from tinker_atropos.environment.backends.base import EnvBatch, make_env_batch
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.launcher.up import Child, service_children
from tinker_atropos.runtime import child_preexec
from tinker_atropos.state.connection import connect
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.experience import ExperienceReader, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import publish_weights

STARTUP_TIMEOUT_S = 120.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Timing:
    """Warm-up, then a measured window per phase, cut into ``rounds`` slices that alternate with the other
    phases' slices (so the machine's drift hits every phase alike)."""

    warmup_s: float
    window_s: float
    rounds: int = 1

    @property
    def slice_s(self) -> float:
        return self.window_s / self.rounds


COUNTER_POLL_S = 0.01
# Unmeasured run-in before each slice: the phase that ran before it left its own data in the caches.
SETTLE_S = 1.0


class Meter(Protocol):
    """One way of stepping the env, set up and warmed up, idle (or paused) between its measured slices."""

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        """Run ``settle_s`` unmeasured, then ``window_s``: (env steps, seconds) of the latter; then idle."""
        ...


class SteppingMeter:
    """A phase this process drives itself: ``step`` does one batch step and returns the env steps done."""

    def __init__(self, step: Callable[[], int], warmup_s: float) -> None:
        self._step = step
        self.count(0.0, warmup_s)

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        end_settle = time.monotonic() + settle_s
        while time.monotonic() < end_settle:
            self._step()
        start, steps = time.monotonic(), 0
        while (now := time.monotonic()) - start < window_s:
            steps += self._step()
        return steps, now - start


def _random_batch_stepper(batch: EnvBatch, seed: int) -> Callable[[], int]:
    batch.reset(seed)
    actions = gym.vector.utils.batch_space(batch.action_space, batch.num_instances)
    actions.seed(seed)

    def step() -> int:
        batch.step(actions.sample())
        return batch.num_instances

    return step


@contextmanager
def raw_meter(config: Config, timing: Timing, backend: str | None = None) -> Iterator[Meter]:
    """All the env services' instances stepped in this process with random actions: the simulator alone, no
    services. gymnasium's own envs one after the other, or ``backend`` on as many threads as the env services
    have in all."""
    env = config.env
    batch: EnvBatch = (
        GymnasiumBatch(env.id, env.kwargs, env.total_instances)
        if backend is None
        else make_env_batch(backend, env.id, env.kwargs, env.total_instances, env.threads * env.services)
    )
    try:
        yield SteppingMeter(_random_batch_stepper(batch, config.run.seed), timing.warmup_s)
    finally:
        batch.close()


@contextmanager
def envpool_meter(config: Config, timing: Timing) -> Iterator[Meter | None]:
    """EnvPool (C++ thread pool) on the same env id and count; None when EnvPool or the id is missing."""
    try:
        import envpool
    except ImportError:
        yield None
        return
    if config.env.id not in envpool.list_all_envs():
        yield None
        return
    instances = config.env.total_instances
    pool = envpool.make_gymnasium(
        config.env.id, num_envs=instances, seed=config.run.seed, **config.env.kwargs
    )
    try:
        pool.reset()
        actions = gym.vector.utils.batch_space(pool.action_space, instances)
        actions.seed(config.run.seed)

        def step() -> int:
            pool.step(actions.sample())
            return instances

        yield SteppingMeter(step, timing.warmup_s)
    finally:
        pool.close()


def interleaved_rates(meters: dict[str, Meter], timing: Timing) -> dict[str, list[tuple[int, float]]]:
    """Each meter's (env steps, seconds) per round: a round gives every meter one slice, in an order that
    rotates from round to round, so no phase always runs right after the same other one."""
    names = list(meters)
    slices: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for round_ in range(timing.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            slices[name].append(meters[name].count(SETTLE_S, timing.slice_s))
    return slices


def initial_policy(config: Config) -> tuple[bytes, dict[str, Any]]:
    """Version-0 weights and spec, built as the trainer builds them (spaces from a local instance)."""
    probe = gym.make(config.env.id, **config.env.kwargs)
    try:
        ppo = config.trainer.ppo
        spec = policy_spec(
            probe.observation_space,
            probe.action_space,
            config.trainer.model,
            ppo.normalize_observations,
            ppo.normalize_returns,
        )
    finally:
        probe.close()
    learner = PPOLearner(spec, config.trainer, torch.device("cpu"), config.run.seed)
    return learner.weights(), spec


def _wait_until(condition: Callable[[], Any], timeout_s: float, what: str, children: list[Child]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        for child in children:
            if child.process is not None and child.process.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.process.returncode}; see {child.log_path}"
                )
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@contextmanager
def _services(children: list[Child]) -> Iterator[list[Child]]:
    """Start service processes and always stop them, as ``up`` does."""
    try:
        for child in children:
            child.start()
        yield children
    finally:
        for child in children:
            child.terminate()
        deadline = time.monotonic() + 10.0
        for child in children:
            child.wait(deadline)


def _drain(client: redis.Redis, run: str, stop: threading.Event) -> None:
    """Consume chunks as a trainer would, so the bounded stream never throttles collection."""
    reader = ExperienceReader(client, run)
    while not stop.is_set():
        reader.take(count=64, block_ms=200)


class ServicesMeter:
    """Service processes counted by the run's ``env_steps`` stat, paused with SIGSTOP between slices: paused,
    they take no CPU from the other phases, and they resume with their connections and warm state intact."""

    def __init__(self, children: list[Child], steps: Callable[[], int]) -> None:
        self._children, self._steps = children, steps

    def _signal(self, signum: signal.Signals) -> None:
        for child in self._children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        """The counter moves a whole chunk at a time (a thousand steps for Humanoid), too coarse for a slice of
        a few seconds: the rate is taken between its first and last moves within the window instead."""
        self.resume()
        try:
            time.sleep(settle_s)
            start, initial = time.monotonic(), self._steps()
            moves: list[tuple[float, int]] = []  # (time, steps) whenever the counter moved
            while time.monotonic() - start < window_s:
                time.sleep(COUNTER_POLL_S)
                if (steps := self._steps()) != (moves[-1][1] if moves else initial):
                    moves.append((time.monotonic(), steps))
            if len(moves) < 2:  # too slow to move twice: the whole window, coarse as it is
                return self._steps() - initial, time.monotonic() - start
            (first_time, first_steps), (last_time, last_steps) = moves[0], moves[-1]
            return last_steps - first_steps, last_time - first_time
        finally:
            self.pause()


@contextmanager
def collect_meter(
    config: Config, timing: Timing, work_dir: Path, transport: Transport | None = None
) -> Iterator[ServicesMeter]:
    """Env service(s) + one rollout service as processes with the real policy, over the config's transport
    (or ``transport``), chunks written to Redis and drained here: collection without learning."""
    config = config.model_copy(deep=True)
    config.rollout.transport = transport or config.rollout.transport
    config.rollout.flow_control = "drop"
    config.rollout.replicas = 1
    run = config.run.name
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    server = EmbeddedValkey(work_dir / "valkey")
    client = connect(server.url)
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(client, run, stop), daemon=True)
    try:
        publish_weights(client, run, 0, *initial_policy(config))
        children = [
            c for c in service_children(config, config_path, server.url, work_dir) if c.name != "trainer"
        ]
        for child in children:  # paused between slices, they could not act on a SIGTERM if this process died
            child.death_signal = signal.SIGKILL
        with _services(children):
            drainer.start()
            steps = lambda: read_stats(client, run).get("env_steps", 0)  # noqa: E731
            _wait_until(steps, STARTUP_TIMEOUT_S, "the first chunk", children)
            time.sleep(timing.warmup_s)
            meter = ServicesMeter(children, steps)
            meter.pause()
            try:
                yield meter
            finally:
                meter.resume()  # a stopped process would not act on the SIGTERM that stops it
    finally:
        stop.set()
        if drainer.is_alive():
            drainer.join()
        client.close()
        server.stop()


def collect_steps_per_s(
    config: Config, timing: Timing, work_dir: Path, transport: Transport | None = None
) -> float:
    """``collect_meter``'s rate over one window, alone on the machine."""
    with collect_meter(config, timing, work_dir, transport) as meter:
        steps, seconds = meter.count(0.0, timing.window_s)
    return steps / seconds


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc (fields 14 and 15 of stat, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _service_pids(parent: int) -> dict[str, int]:
    """The service processes of ``tinker-atropos up`` (its children), named by their command."""
    services = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != parent or b"tinker_atropos" not in argv:
            continue
        kind = argv[argv.index(b"tinker_atropos") + 1].decode()
        name, n = kind, 0
        while name in services:
            n += 1
            name = f"{kind}-{n}"
        services[name] = int(entry.name)
    return services


def _metrics_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_figures(config: Config, timing: Timing, work_dir: Path) -> dict[str, Any]:
    """The whole system learning, exactly as ``tinker-atropos up`` runs it, stopped with Ctrl-C (SIGINT).

    The window starts ``warmup_s`` after the first env steps are counted; its rate comes from metrics.jsonl,
    the trainer's lag range from its registry figures and the CPU time of each service from /proc.
    """
    config = config.model_copy(deep=True)
    config.run.report_interval_s = min(config.run.report_interval_s, 1.0)
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    metrics = work_dir / "run" / "metrics.jsonl"
    server = EmbeddedValkey(work_dir / "valkey")
    client = connect(server.url)
    log = open(work_dir / "up.log", "w")  # noqa: SIM115 - closed below
    command = [sys.executable, "-m", "tinker_atropos", "up", str(config_path), "--total-steps", str(10**12)]
    command += ["--run-dir", str(work_dir / "run"), "--redis-url", server.url]
    up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not any(r["env_steps"] > 0 for r in _metrics_rows(metrics)):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`tinker-atropos up` collected no env steps; see {work_dir / 'up.log'}")
            time.sleep(0.2)
        time.sleep(timing.warmup_s)
        pids = _service_pids(up.pid) | {"launcher": up.pid}
        cpu_start = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        window_start = _metrics_rows(metrics)[-1]
        time.sleep(timing.window_s)
        rows = _metrics_rows(metrics)
        cpu = {name: round(_cpu_seconds(pid) - cpu_start[name], 2) for name, pid in pids.items()}
        trainers = live_services(client, config.run.name, "trainer")
        trainer = trainers[0].figures if trainers else {}
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        log.close()
        client.close()
        server.stop()
    window = [r for r in rows if r["wall_time_s"] > window_start["wall_time_s"]]
    end = window[-1] if window else window_start
    seconds = end["wall_time_s"] - window_start["wall_time_s"]
    return {
        "train_env_steps_per_s": (end["env_steps"] - window_start["env_steps"]) / seconds
        if seconds
        else None,
        "trainer_busy": float(np.mean([r["trainer_busy"] for r in window])) if window else None,
        "policy_lag": {
            "min": trainer.get("policy_lag_min"),
            "mean": float(np.mean([r["policy_lag_mean"] for r in window])) if window else None,
            "max": trainer.get("policy_lag_max"),
        },
        "policy_versions": [window_start["policy_version"], end["policy_version"]],
        "cpu_seconds_per_service": cpu,
        "window_measured_s": round(seconds, 2),
    }


def sb3_ppo(config: Config) -> Any:
    """Stable-Baselines3 PPO set up as our trainer is: same env and instance count (DummyVecEnv), same batch,
    minibatches, epochs and hyper-parameters, observations and returns normalised (VecNormalize). Raises
    ImportError without SB3; the caller closes ``model.get_env()``."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    env, ppo, instances = config.env, config.trainer.ppo, config.env.total_instances
    per_session = env.instances // config.rollout.sessions_per_env
    batch = config.trainer.chunks_per_update * config.rollout.chunk_length * max(per_session, 1)
    n_steps = max(batch // instances, 1)
    venv = make_vec_env(
        env.id, n_envs=instances, seed=config.run.seed, env_kwargs=env.kwargs, vec_env_cls=DummyVecEnv
    )
    venv = VecNormalize(
        venv, norm_obs=ppo.normalize_observations, norm_reward=ppo.normalize_returns, gamma=ppo.gamma
    )
    return PPO(
        "MlpPolicy",
        venv,
        n_steps=n_steps,
        batch_size=max(n_steps * instances // ppo.num_minibatches, 2),
        n_epochs=ppo.update_epochs,
        learning_rate=ppo.learning_rate,
        gamma=ppo.gamma,
        gae_lambda=ppo.gae_lambda,
        clip_range=ppo.clip_coef,
        ent_coef=ppo.ent_coef,
        vf_coef=ppo.vf_coef,
        max_grad_norm=ppo.max_grad_norm,
        policy_kwargs={"net_arch": list(config.trainer.model.hidden_sizes)},
        seed=config.run.seed,
        device="cpu",
    )


def sb3_ppo_steps_per_s(config: Config, timing: Timing) -> float | None:
    """Stable-Baselines3 PPO set up as ours (``sb3_ppo``): ``learn()`` steps/s over the window, training
    included. None without SB3."""
    try:
        from stable_baselines3.common.callbacks import BaseCallback

        model = sb3_ppo(config)
    except ImportError:
        return None

    class Window(BaseCallback):
        """Marks the end of the warm-up and stops ``learn()`` when the window is over."""

        def __init__(self) -> None:
            super().__init__()
            self.start = time.monotonic()
            self.window_start: tuple[float, int] | None = None
            self.rate: float | None = None

        def _on_step(self) -> bool:
            now = time.monotonic()
            if self.window_start is None:
                if now - self.start >= timing.warmup_s:
                    self.window_start = (now, self.num_timesteps)
                return True
            started, steps = self.window_start
            if now - started < timing.window_s:
                return True
            self.rate = (self.num_timesteps - steps) / (now - started)
            return False

    window = Window()
    try:
        model.learn(total_timesteps=10**12, callback=window)
    finally:
        model.get_env().close()
    return window.rate


def scaling_curve(
    config: Config, timing: Timing, services: list[int], delay_s: float, wrapped_id: str, work_dir: Path
) -> dict[str, Any]:
    """Collection throughput with 1, 2, 4, … env services of a latency-bound env, and efficiency vs linear.

    The env is ``wrapped_id`` behind ``TinkerAtropos/Delayed-v0`` (``delay_s`` per batch step of a session):
    a simulator on another node, whose latency more env services can hide while the CPU here stays free.
    """
    from tinker_atropos.environment.delay import ENV_ID

    base = config.model_copy(deep=True)
    base.env.id, base.env.kwargs, base.env.backend = (
        ENV_ID,
        {"env_id": wrapped_id, "delay_s": delay_s},
        "gymnasium",
    )
    points = []
    for n in services:
        base.env.services = n
        rate = collect_steps_per_s(base, timing, work_dir / f"services-{n}")
        points.append({"env_services": n, "env_steps_per_s": rate})
    single = points[0]["env_steps_per_s"] / points[0]["env_services"]
    for point in points:
        point["efficiency_vs_linear"] = (
            point["env_steps_per_s"] / (single * point["env_services"]) if single else None
        )
        # what the latency alone allows: every session steps its instances once per delay
        bound = point["env_services"] * config.env.instances / delay_s if delay_s else None
        point["efficiency_vs_latency_bound"] = point["env_steps_per_s"] / bound if bound else None
    return {
        "env_id": ENV_ID,
        "wrapped_env_id": wrapped_id,
        "delay_s_per_batch_step": delay_s,
        "instances_per_service": config.env.instances,
        "sessions_per_env": config.rollout.sessions_per_env,
        "points": points,
    }
