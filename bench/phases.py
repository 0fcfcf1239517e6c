"""The benchmark's phases: each measures env steps per second of one way to run the same env and instances.

Every phase runs a warm-up (imports, JIT-free but cache- and allocator-warming first steps, service start-up
excluded) and then counts the env steps of a fixed wall-time window. One env step is one ``env.step`` of one
instance (for MuJoCo locomotion, 5 physics steps).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym
import mujoco
import numpy as np
import redis
import torch
import yaml
from gymnasium.envs.mujoco.mujoco_env import expand_model_path

from bench import sf_peer
from tests.support.loops import initial_policy
from tinker_atropos.config import Config, Transport, parse_config
from tinker_atropos.environment.backends.base import BatchSetup, EnvBatch, make_env_batch
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.environment.backends.mujoco_batch import MujocoBatch
from tinker_atropos.launcher.secrets import write_secrets
from tinker_atropos.launcher.services import service_children
from tinker_atropos.launcher.supervisor import Child
from tinker_atropos.security import derive_key
from tinker_atropos.state.connection import connect
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.experience import ExperienceReader, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import publish_weights
from tinker_atropos.trainer.figures import BUSY_WINDOW_S

STARTUP_TIMEOUT_S = 120.0
# Env steps per mujoco.rollout call of the physics limit: one call's Python (controls drawn, health checked)
# is then a few percent of its stepping, and a fallen Humanoid runs at most 3 env steps past its end.
LIMIT_CHUNK_STEPS = 4
# Sample Factory's report interval: its env-step counter, read by the meter, moves at most this often
SF_REPORT_S = 0.5
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Timing:
    """Warm-up, then a measured window per phase, cut into ``rounds`` slices that alternate with the other
    phases' slices (so the machine's drift hits every phase alike)."""

    warmup_s: float
    window_s: float
    rounds: int = 1
    # the trainer figures' run-in: the trainer's busy window, so no pause falls inside the fractions read
    figures_run_in_s: float = BUSY_WINDOW_S

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
        GymnasiumBatch(BatchSetup(env.id, env.kwargs, env.total_instances))
        if backend is None
        else make_env_batch(backend, env.id, env.kwargs, env.total_instances, env.threads * env.services)
    )
    try:
        yield SteppingMeter(_random_batch_stepper(batch, config.run.seed), timing.warmup_s)
    finally:
        batch.close()


class PhysicsLimit:
    """The ceiling this machine puts on a MuJoCo env's stepping: its instances advanced by MuJoCo's C++
    ``mujoco.rollout`` on ``num_threads`` threads with the GIL released, random actions, and no Python per step.

    Each call steps every instance ``chunk`` env steps (``frame_skip`` physics steps each, the action held as
    gymnasium holds it); then, with numpy over the recorded states, an instance that ended its episode at any of
    those steps (the env's own health rule and time limit, from our mujoco backend's task) starts a new one from
    gymnasium's reset noise. So a fallen humanoid is stepped at most ``chunk - 1`` env steps longer than
    gymnasium would; nothing else of an env step is done (no observation, reward or ``mj_rnePostConstraint``).
    """

    def __init__(
        self,
        env_id: str,
        kwargs: dict[str, Any],
        num_instances: int,
        num_threads: int,
        seed: int,
        chunk: int = LIMIT_CHUNK_STEPS,
    ) -> None:
        from mujoco import rollout

        # the backend's task knows the env's health rule, time limit and reset noise; only qpos/qvel are read
        rules = MujocoBatch(BatchSetup(env_id, kwargs, 1, 1))
        self._task, self._max_steps = rules._task, rules._max_episode_steps
        self._noise, self._normal_qvel_noise = rules._noise_scale, rules._task.normal_qvel_noise
        self.model = mujoco.MjModel.from_xml_path(expand_model_path(self._task.params["xml_file"]))
        self._frame_skip = int(self._task.params["frame_skip"])
        self._chunk, self.num_instances = chunk, num_instances
        self._datas = [mujoco.MjData(self.model) for _ in range(num_threads)]
        self._rollout = rollout.Rollout(nthread=num_threads)
        spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
        self._qpos_at = mujoco.mj_stateSize(self.model, mujoco.mjtState.mjSTATE_TIME)
        self._qvel_at = self._qpos_at + self.model.nq
        self._rng = np.random.default_rng(seed)
        self._low, self._high = self.model.actuator_ctrlrange.T
        self.states = np.empty((num_instances, mujoco.mj_stateSize(self.model, spec)))
        self._out = np.empty((num_instances, chunk * self._frame_skip, self.states.shape[1]))
        self._elapsed = np.zeros(num_instances, dtype=np.int64)
        self.episodes = 0
        self.reset(np.arange(num_instances))

    @property
    def qpos(self) -> np.ndarray:
        """Every instance's joint positions now, [N, nq]."""
        return self.states[:, self._qpos_at : self._qvel_at]

    def reset(self, ids: np.ndarray) -> None:
        """gymnasium's ``reset_model`` for instances ``ids``: qpos0 plus uniform noise, qvel uniform or normal."""
        model, scale, data = self.model, self._noise, self._datas[0]
        for i in ids:
            mujoco.mj_resetData(model, data)
            data.qpos[:] = model.qpos0 + self._rng.uniform(-scale, scale, model.nq)
            draw = self._rng.standard_normal(model.nv) * scale
            data.qvel[:] = draw if self._normal_qvel_noise else self._rng.uniform(-scale, scale, model.nv)
            mujoco.mj_forward(model, data)
            mujoco.mj_getState(model, data, self.states[i], mujoco.mjtState.mjSTATE_FULLPHYSICS)
        self._elapsed[ids] = 0

    def step(self) -> int:
        """``chunk`` env steps of every instance in one ``mujoco.rollout`` call, then the episodes that ended
        restarted; returns the env steps done."""
        n, chunk, skip = self.num_instances, self._chunk, self._frame_skip
        actions = self._rng.uniform(self._low, self._high, (n, chunk, len(self._low)))
        self._rollout.rollout(
            self.model,
            self._datas,
            self.states,
            np.repeat(actions, skip, axis=1),
            control_spec=mujoco.mjtState.mjSTATE_CTRL,
            state=self._out,
        )
        ends = self._out[:, skip - 1 :: skip]  # the state after each env step, [n, chunk, nstate]
        fields = {
            "qpos": ends[..., self._qpos_at : self._qvel_at].reshape(n * chunk, -1),
            "qvel": ends[..., self._qvel_at : self._qvel_at + self.model.nv].reshape(n * chunk, -1),
        }
        ended = np.zeros(n, dtype=bool)
        if self._task.terminate_when_unhealthy:
            ended |= ~self._task.is_healthy(fields).reshape(n, chunk).all(axis=1)
        self._elapsed += chunk
        if self._max_steps is not None:
            ended |= self._elapsed >= self._max_steps
        self.states[:] = self._out[:, -1]
        if ended.any():
            self.reset(np.flatnonzero(ended))
            self.episodes += int(ended.sum())
        return n * chunk

    def close(self) -> None:
        self._rollout.close()


@contextmanager
def limit_meter(config: Config, timing: Timing) -> Iterator[Meter | None]:
    """``PhysicsLimit`` for the config's env, instances and the threads of all its env services; None for an env
    our mujoco backend does not implement (its health rule is where the limit's reset rule comes from)."""
    env = config.env
    try:
        limit = PhysicsLimit(
            env.id, env.kwargs, env.total_instances, env.threads * env.services, config.run.seed
        )
    except ValueError:  # not one of the backend's MuJoCo envs
        yield None
        return
    try:
        yield SteppingMeter(limit.step, timing.warmup_s)
    finally:
        limit.close()


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


def secure_environment(folder: Path) -> dict[str, str]:
    """What every service of a protected run gets, from the files of ``tinker-atropos secrets`` made in
    ``folder``: the token on every call (and the keys that sign records), the Redis password, mutual TLS."""
    write_secrets(folder)
    files = {
        "TA_TOKEN_FILE": "token",
        "TA_REDIS_PASSWORD_FILE": "redis-password",
        "TA_TLS_CERT": "tls.crt",
        "TA_TLS_KEY": "tls.key",
        "TA_TLS_CA": "ca.crt",
        "TA_TLS_CLIENT_CA": "ca.crt",
    }
    return {variable: str(folder / name) for variable, name in files.items()}


def _drain(client: redis.Redis, run: str, stop: threading.Event, key: bytes | None) -> None:
    """Consume chunks as a trainer would (checking their signatures with ``key``), so the bounded stream never
    throttles collection."""
    reader = ExperienceReader(client, run, key)
    while not stop.is_set():
        reader.take(count=64, block_ms=200)


# kind -> {service name: the figures of its registry entry}
Figures = Callable[[str], dict[str, dict[str, Any]]]


class ServicesMeter:
    """Service processes counted by the run's ``env_steps`` stat, paused with SIGSTOP between slices: paused,
    they take no CPU from the other phases, and they resume with their connections and warm state intact.
    ``services`` reads the registry: the figures of the live services of a kind."""

    def __init__(
        self, children: list[Child], steps: Callable[[], int], services: Figures | None = None
    ) -> None:
        self._children, self.steps = children, steps
        self.services: Figures = services or (lambda _kind: {})

    def child(self, name: str) -> Child:
        return next(c for c in self._children if c.name == name)

    @property
    def pids(self) -> dict[str, int]:
        """The measured processes by service name."""
        return {c.name: c.process.pid for c in self._children if c.process is not None}

    def send(self, signum: signal.Signals) -> None:
        """``signum`` to every process measured."""
        for child in self._children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)

    def resume(self) -> None:
        self.send(signal.SIGCONT)

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        """The counter moves a whole chunk at a time (a thousand steps for Humanoid), too coarse for a slice of
        a few seconds: the rate is taken between its first and last moves within the window instead."""
        self.resume()
        try:
            time.sleep(settle_s)
            start, initial = time.monotonic(), self.steps()
            moves: list[tuple[float, int]] = []  # (time, steps) whenever the counter moved
            while time.monotonic() - start < window_s:
                time.sleep(COUNTER_POLL_S)
                if (steps := self.steps()) != (moves[-1][1] if moves else initial):
                    moves.append((time.monotonic(), steps))
            if len(moves) < 2:  # too slow to move twice: the whole window, coarse as it is
                return self.steps() - initial, time.monotonic() - start
            (first_time, first_steps), (last_time, last_steps) = moves[0], moves[-1]
            return last_steps - first_steps, last_time - first_time
        finally:
            self.pause()


class GpuMonitor:
    """Utilisation of one GPU, read by NVML (``nvidia-ml-py``: the bench extra, and the GPU image has it): the share
    of the last sample period in which a kernel ran (nvidia-smi's GPU-Util) and the memory in use."""

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.name = pynvml.nvmlDeviceGetName(self._handle)
        self.index = index

    def sample(self) -> dict[str, float]:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {
            "util": rates.gpu / 100,
            "memory_util": rates.memory / 100,
            "memory_used_mib": memory.used / 2**20,
        }

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def gpu_monitor(device: str) -> GpuMonitor | str | None:
    """The monitor of the GPU a trainer on ``device`` learns on; None on a CPU; the reason (a string) when NVML
    cannot read it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return None
    try:
        return GpuMonitor(int(device.partition(":")[2] or 0))
    except ImportError:
        return "nvidia-ml-py is not installed (the bench extra)"
    except Exception as error:  # pynvml's NVMLError: no driver, no such device
        return f"NVML: {type(error).__name__}: {error}"


def gpu_figures(monitor: GpuMonitor | str | None, samples: list[dict[str, float]]) -> dict[str, Any] | None:
    if monitor is None:
        return None
    if isinstance(monitor, str):
        return {"unavailable": monitor}
    return {
        "name": monitor.name,
        "index": monitor.index,
        "util_mean": float(np.mean([s["util"] for s in samples])),
        "util_max": max(s["util"] for s in samples),
        "memory_util_mean": float(np.mean([s["memory_util"] for s in samples])),
        "memory_used_mib_max": max(s["memory_used_mib"] for s in samples),
    }


def spread(values: list[float]) -> float | None:
    """max / min of ``values`` (the rollouts' CPU per step: equal shares of work cost alike), None for fewer than 2."""
    return max(values) / min(values) if len(values) >= 2 and min(values) > 0 else None


class TrainMeter(ServicesMeter):
    """The whole system learning; its trainer's figures, each service's CPU time and, with the trainer on a GPU,
    the GPU's utilisation are read in ``figures``, a window in which nothing is paused."""

    def __init__(
        self, children: list[Child], steps: Callable[[], int], services: Figures, gpu: GpuMonitor | str | None
    ) -> None:
        super().__init__(children, steps, services)
        self._gpu = gpu

    def _trainer(self) -> dict[str, Any]:
        return next(iter(self.services("trainer").values()), {})

    def figures(self, timing: Timing) -> dict[str, Any]:
        """Trainer busy fraction and policy lag (sampled each second from the registry), CPU seconds per
        service and the env steps/s, over ``window_s`` after ``warmup_s``; the run-in outlasts the trainer's
        busy window (``Timing.figures_run_in_s``), so none of the pauses falls inside the fractions read."""
        self.resume()
        try:
            time.sleep(max(timing.warmup_s, timing.figures_run_in_s))
            pids = self.pids
            cpu_start = {name: cpu_seconds(pid) for name, pid in pids.items()}
            start, steps_start, samples, gpu = time.monotonic(), self.steps(), [], []
            while time.monotonic() - start < timing.window_s:
                time.sleep(min(1.0, timing.window_s))
                samples.append(self._trainer())
                if isinstance(self._gpu, GpuMonitor):
                    gpu.append(self._gpu.sample())
            seconds, steps = time.monotonic() - start, self.steps() - steps_start
            cpu = {name: round(cpu_seconds(pid) - cpu_start[name], 2) for name, pid in pids.items()}
        finally:
            self.pause()
        last = samples[-1]
        per_step = {
            name: round(1e6 * seconds_ / steps, 1) if steps else None for name, seconds_ in cpu.items()
        }
        rollouts = [us for name, us in per_step.items() if name.startswith("rollout") and us is not None]
        return {
            "unpaused_env_steps_per_s": steps / seconds,
            "trainer_busy": float(np.mean([s.get("busy_fraction", 0.0) for s in samples])),
            "policy_lag": {
                "min": last.get("policy_lag_min"),
                "mean": float(np.mean([s.get("policy_lag_mean", 0.0) for s in samples])),
                "max": last.get("policy_lag_max"),
            },
            "policy_versions": [samples[0].get("policy_version"), last.get("policy_version")],
            "cpu_seconds_per_service": cpu,
            # where the time of an env step goes, service by service: the README's profile table, regenerated
            "cpu_us_per_env_step": per_step,
            "rollout_cpu_spread": spread(rollouts),  # every rollout's share costs alike: near 1
            "gpu": gpu_figures(self._gpu, gpu),
            "window_measured_s": round(seconds, 2),
        }


@contextmanager
def services_meter(
    config: Config,
    timing: Timing,
    work_dir: Path,
    transport: Transport | None = None,
    learn: bool = False,
    secure: bool = False,
    environment: dict[str, str] | None = None,
) -> Iterator[ServicesMeter]:
    """The services as ``tinker-atropos up`` starts them, over the config's transport (or ``transport``), with
    ``environment`` added to theirs.

    With ``learn``, the trainer too: a ``TrainMeter``. Without, collection only: env services and rollouts with
    the real policy, chunks written to Redis and drained here. Without ``secure`` nothing is protected (no token,
    no TLS, no Redis password, records unsigned); with it every link is, as in a deployment
    (``secure_environment``), and the drain checks the records' signatures as a trainer does."""
    config = config.model_copy(deep=True)
    config.rollout.transport = transport or config.rollout.transport
    if not learn:
        config.rollout.flow_control = "drop"
    run = config.run.name
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    environment = {**(environment or {}), **(secure_environment(work_dir / "secrets") if secure else {})}
    token = (work_dir / "secrets" / "token").read_text().strip() if secure else None
    password = (work_dir / "secrets" / "redis-password").read_text().strip() if secure else None
    server = EmbeddedValkey(work_dir / "valkey", password=password)
    client = connect(server.client_url)
    stop = threading.Event()
    experience_key = None if token is None else derive_key(token, "experience")
    drainer = threading.Thread(target=_drain, args=(client, run, stop, experience_key), daemon=True)
    try:
        children = service_children(config, config_path, server.url, work_dir)
        if not learn:
            weights_key = None if token is None else derive_key(token, "weights")
            publish_weights(client, run, 0, *initial_policy(config), key=weights_key)
            children = [c for c in children if c.name != "trainer"]
        for child in children:  # paused between slices, they could not act on a SIGTERM if this process died
            child.death_signal = signal.SIGKILL
            child.environment.update(environment)
        with _services(children):
            if not learn:
                drainer.start()
            steps = lambda: read_stats(client, run).get("env_steps", 0)  # noqa: E731

            def services(kind: str) -> dict[str, dict[str, Any]]:
                return {record.name: record.figures for record in live_services(client, run, kind)}

            _wait_until(steps, STARTUP_TIMEOUT_S, "the first chunk", children)
            _wait_until(
                lambda: _all_acting(config, services("rollout")),
                STARTUP_TIMEOUT_S,
                "every rollout to take its share of the env services",
                children,
            )
            time.sleep(timing.warmup_s)

            gpu = gpu_monitor(config.trainer.device) if learn else None
            meter = (
                TrainMeter(children, steps, services, gpu)
                if learn
                else ServicesMeter(children, steps, services)
            )
            meter.pause()
            try:
                yield meter
            finally:
                meter.resume()  # a stopped process would not act on the SIGTERM that stops it
                if isinstance(gpu, GpuMonitor):
                    gpu.close()
    finally:
        stop.set()
        if drainer.is_alive():
            drainer.join()
        client.close()
        server.stop()


def _all_acting(config: Config, rollouts: dict[str, dict[str, Any]]) -> bool:
    """Every instance held, by as many rollouts as there are (or as there are session slots)."""
    env = config.env
    slots = env.services * min(config.rollout.sessions_per_env, env.instances)
    held = [f.get("instances_held", 0) for f in rollouts.values()]
    return sum(held) == env.total_instances and sum(n > 0 for n in held) == min(
        config.rollout.replicas, slots
    )


class ProcessGroupMeter(ServicesMeter):
    """A peer run as its own process group (its learner, samplers and env workers), all paused with SIGSTOP
    between slices and counted by the env steps it reports."""

    def __init__(self, group: int, steps: Callable[[], int]) -> None:
        super().__init__([], steps)
        self._group = group

    def send(self, signum: signal.Signals) -> None:
        # a group already gone: the next count finds no progress and the phase's log says why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._group, signum)

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        """Such a peer reports once per training iteration (Sample Factory: 4,096 steps, a second or more), too
        seldom for a slice of a few seconds to hold two reports: its slice runs from one report to the first
        one at least ``window_s`` later, whole iterations, a little past ``window_s``."""
        self.resume()
        try:
            time.sleep(settle_s)
            start_time, start_steps = self._next_report()
            while True:
                now, steps = self._next_report()
                if now - start_time >= window_s:
                    return steps - start_steps, now - start_time
        finally:
            self.pause()

    def _next_report(self) -> tuple[float, int]:
        """(time, env steps) when the counter next moves."""
        before, deadline = self.steps(), time.monotonic() + STARTUP_TIMEOUT_S
        while (steps := self.steps()) == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the peer reported no progress for {STARTUP_TIMEOUT_S:g}s")
            time.sleep(COUNTER_POLL_S)
        return time.monotonic(), steps


def last_env_steps(curve: Path) -> int:
    """The env steps of the last complete line of a JSON-lines curve (0 before the first)."""
    try:
        with open(curve, "rb") as lines:
            lines.seek(max(lines.seek(0, os.SEEK_END) - 512, 0))
            complete = lines.read().rsplit(b"\n", 2)
    except FileNotFoundError:
        return 0
    return json.loads(complete[-2])["env_steps"] if len(complete) >= 2 else 0


@contextmanager
def sample_factory_meter(config: Config, timing: Timing, work_dir: Path) -> Iterator[Meter | None]:
    """Sample Factory 2.x training with its tuned MuJoCo defaults (``async_rl`` off, as they set it) on the
    config's env (its v4) and instance count, from its own venv, counted by the env steps in its own reports;
    None when it cannot run here (``sf_peer.unavailable`` says why, in the result's ``unavailable``)."""
    if sf_peer.unavailable(config) is not None:
        yield None
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    command = sf_peer.sf_command(config, 10**9, SF_REPORT_S, work_dir, async_rl=False)
    curve = work_dir / "curve.jsonl"
    with open(work_dir / "sf.log", "w") as log:
        sf = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    meter = ProcessGroupMeter(sf.pid, lambda: last_env_steps(curve))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while last_env_steps(curve) == 0:
            if sf.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Sample Factory did not start training; see {work_dir / 'sf.log'}")
            time.sleep(0.2)
        time.sleep(timing.warmup_s)
        meter.pause()
        yield meter
    finally:
        meter.resume()
        meter.send(signal.SIGINT)  # its runner stops cleanly on an interrupt, then its workers
        try:
            sf.wait(timeout=30)
        except subprocess.TimeoutExpired:
            meter.send(signal.SIGKILL)
            sf.wait()


def collect_steps_per_s(
    config: Config, timing: Timing, work_dir: Path, transport: Transport | None = None
) -> float:
    """Collection's rate (``services_meter``) over one window, alone on the machine."""
    with services_meter(config, timing, work_dir, transport) as meter:
        steps, seconds = meter.count(0.0, timing.window_s)
    return steps / seconds


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc (fields 14 and 15 of stat, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def sb3_envs(config: Config, subprocesses: bool = False) -> Any:
    """SB3's vectorised env: the config's env and instance count, stepped one after the other (DummyVecEnv) or,
    with ``subprocesses``, one process per instance (SubprocVecEnv: what a user with several cores picks)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    env = config.env
    return make_vec_env(
        env.id,
        n_envs=env.total_instances,
        seed=config.run.seed,
        env_kwargs=env.kwargs,
        vec_env_cls=SubprocVecEnv if subprocesses else DummyVecEnv,
    )


def sb3_ppo(config: Config, subprocesses: bool = False) -> Any:
    """Stable-Baselines3 PPO set up as our trainer is: same env and instance count (``sb3_envs``), same batch,
    minibatches, epochs and hyper-parameters, observations and returns normalised (VecNormalize). Raises
    ImportError without SB3; the caller closes ``model.get_env()``."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecNormalize

    ppo, instances = config.trainer.hyperparameters, config.env.total_instances
    n_steps = max(config.trainer.samples_per_update // instances, 1)
    venv = VecNormalize(
        sb3_envs(config, subprocesses),
        norm_obs=ppo.normalize_observations,
        norm_reward=ppo.normalize_returns,
        gamma=ppo.gamma,
    )
    return PPO(
        "MlpPolicy",
        venv,
        n_steps=n_steps,
        batch_size=max(n_steps * instances // ppo.num_minibatches, 2),
        n_epochs=ppo.update_epochs,
        learning_rate=ppo.learning_rate,
        gamma=ppo.gamma,
        # APPO's V-trace lambda plays the part of GAE's: SB3 PPO is APPO's nearest peer in SB3
        gae_lambda=ppo.vtrace_lambda if config.trainer.algorithm == "appo" else ppo.gae_lambda,
        clip_range=ppo.clip_coef,
        ent_coef=ppo.ent_coef,
        vf_coef=ppo.vf_coef,
        max_grad_norm=ppo.max_grad_norm,
        policy_kwargs={"net_arch": list(config.trainer.model.hidden_sizes)},
        seed=config.run.seed,
        device="cpu",
    )


def sb3_sac(config: Config) -> Any:
    """Stable-Baselines3 SAC set up as our SAC is: same env and instance count (DummyVecEnv), network, batch,
    buffer, learning start, discount, Polyak step, temperature, and update-to-data ratio (one collection step of
    every instance, then ``utd_ratio x instances`` gradient steps). SB3 has one learning rate for actor and
    critics: a config with two different ones is refused rather than compared unlike for like."""
    from stable_baselines3 import SAC
    from torch import nn

    sac, instances = config.trainer.hyperparameters, config.env.total_instances
    if sac.policy_learning_rate != sac.q_learning_rate:
        raise ValueError(
            "SB3 SAC has one learning rate: set trainer.sac.policy_learning_rate and q_learning_rate equal"
        )
    model = config.trainer.model
    return SAC(
        "MlpPolicy",
        sb3_envs(config),
        learning_rate=sac.policy_learning_rate,
        buffer_size=sac.buffer_size,
        learning_starts=sac.learning_starts,
        batch_size=sac.batch_size,
        tau=sac.tau,
        gamma=sac.gamma,
        train_freq=1,
        gradient_steps=max(round(sac.utd_ratio * instances), 1),
        ent_coef="auto" if sac.alpha is None else sac.alpha,
        target_entropy="auto" if sac.target_entropy is None else sac.target_entropy,
        policy_kwargs={
            "net_arch": list(model.hidden_sizes),
            "activation_fn": {"relu": nn.ReLU, "tanh": nn.Tanh}[model.activation],
        },
        seed=config.run.seed,
        device="cpu",
    )


class IterationGate:
    """Runs a learner in slices of whole iterations, on command over ``conn``.

    SB3 steps in bursts, a collection of n_steps then the whole update, so a slice of a few seconds cut
    anywhere would count a burst or a pause. Called at every iteration boundary with the steps done so far,
    the gate lets iterations run until the slice's time is reached, sends (steps, seconds) of the slice, then
    blocks until the next slice's length arrives. A closed pipe (the benchmark gone) raises EOFError.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._slice: tuple[float, float, int] | None = None  # (length, start, steps at start)

    def boundary(self, steps: int) -> None:
        now = time.monotonic()
        if self._slice is not None:
            length, start, steps_at_start = self._slice
            if now - start < length:
                return
            self._conn.send((steps - steps_at_start, now - start))
        length = self._conn.recv()
        self._slice = (length, time.monotonic(), steps)


class GatedMeter:
    """A meter whose stepping runs in another process behind an ``IterationGate``. Its slices hold whole
    iterations, so they run a little past ``window_s``; ``settle_s`` is not run, since an iteration takes
    seconds and re-warms the caches within its first milliseconds."""

    def __init__(self, conn: Connection, warmup_s: float) -> None:
        self._conn = conn
        self.count(0.0, warmup_s)

    def count(self, settle_s: float, window_s: float) -> tuple[int, float]:
        try:
            self._conn.send(window_s)
            if not self._conn.poll(STARTUP_TIMEOUT_S + 10 * window_s):
                raise RuntimeError(f"the gated learner reported no slice of {window_s:g}s in time")
            return self._conn.recv()
        except (EOFError, BrokenPipeError) as error:
            raise RuntimeError("the gated learner's process ended; its error is above") from error


def _sb3_worker(conn: Connection, config_yaml: str, subprocesses: bool) -> None:
    """A child process: ``sb3_ppo`` learning behind an IterationGate until the benchmark closes the pipe."""
    from stable_baselines3.common.callbacks import BaseCallback

    gate = IterationGate(conn)

    class AtIterationStart(BaseCallback):
        def _on_rollout_start(self) -> None:
            gate.boundary(self.num_timesteps)

        def _on_step(self) -> bool:
            return True

    model = sb3_ppo(parse_config(yaml.safe_load(config_yaml)), subprocesses)
    try:
        model.learn(total_timesteps=10**12, callback=AtIterationStart())
    except EOFError:
        pass  # the benchmark is over
    finally:
        model.get_env().close()


@contextmanager
def sb3_meter(config: Config, timing: Timing, subprocesses: bool = False) -> Iterator[Meter | None]:
    """Stable-Baselines3 PPO set up as ours (``sb3_ppo``), ``learn()`` in a child process, training included;
    None without SB3. The child waits, blocked, between slices (with ``subprocesses``, its env processes wait
    on it)."""
    if importlib.util.find_spec("stable_baselines3") is None:
        yield None
        return
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no state of this process's torch
    conn, child_conn = context.Pipe()
    process = context.Process(target=_sb3_worker, args=(child_conn, config.to_yaml(), subprocesses))
    process.start()
    child_conn.close()
    try:
        yield GatedMeter(conn, timing.warmup_s)
    finally:
        conn.close()  # the child's next iteration boundary raises EOFError and it exits
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()


def scaling_curve(
    config: Config, timing: Timing, services: list[int], delay_s: float, wrapped_id: str, work_dir: Path
) -> dict[str, Any]:
    """Collection throughput with 1, 2, 4, … env services of a latency-bound env, and efficiency vs linear.

    The env is ``wrapped_id`` behind ``bench.delay:DelayedEnv`` (``delay_s`` per batch step of a session):
    a simulator on another node, whose latency more env services can hide while the CPU here stays free.
    """
    from bench.delay import ENV_ID

    base = config.model_copy(deep=True)
    base.env.id = ENV_ID
    base.env.kwargs = {"env_id": wrapped_id, "delay_s": delay_s}
    base.env.backend = "gymnasium"
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


ROLLOUT_SCALING_SERVICES, ROLLOUT_SCALING_INSTANCES, ROLLOUT_SCALING_SLOTS, ROLLOUT_SCALING_CHUNK = (
    4,
    16,
    2,
    16,
)
TAKEOVER_POLL_S = 0.05


def rollout_scaling_curve(
    config: Config, timing: Timing, rollouts: list[int], delay_s: float, env_id: str, work_dir: Path
) -> dict[str, Any]:
    """Collection throughput with 1, 2, 4, … rollouts sharing the same env services, when acting is what limits it.

    Each rollout acts with ``bench.slow_acting:SlowActingMLP``: ``delay_s`` per batch, one batch at a time per
    process (a rollout whose policy fills its device), so one rollout acts ``1 / delay_s`` batches per second
    whatever it holds, and only more rollouts make more steps. The env (``env_id``, cheap) runs in
    ``ROLLOUT_SCALING_SERVICES`` env services of ``ROLLOUT_SCALING_INSTANCES``, ``ROLLOUT_SCALING_SLOTS`` session
    slots each: enough slots for 4 rollouts. Besides the rate, each point has every rollout's share of the steps;
    at 2 rollouts, one is SIGKILLed after the window (``takeover``)."""
    from bench.slow_acting import DELAY_VARIABLE, NETWORK

    base = config.model_copy(deep=True)
    base.env.id, base.env.kwargs, base.env.backend = env_id, {}, "gymnasium"
    base.env.services, base.env.instances = ROLLOUT_SCALING_SERVICES, ROLLOUT_SCALING_INSTANCES
    base.rollout.sessions_per_env, base.trainer.model.network = ROLLOUT_SCALING_SLOTS, NETWORK
    # slow acting: short chunks, so the step counter moves often
    base.rollout.chunk_length = ROLLOUT_SCALING_CHUNK
    points = []
    for n in rollouts:
        base.rollout.replicas = n
        environment = {DELAY_VARIABLE: str(delay_s)}
        with services_meter(base, timing, work_dir / f"rollouts-{n}", environment=environment) as meter:
            before = {name: f.get("env_steps", 0) for name, f in meter.services("rollout").items()}
            steps, seconds = meter.count(0.0, timing.window_s)
            after = {
                name: f.get("env_steps", 0) - before.get(name, 0)
                for name, f in meter.services("rollout").items()
            }
            point = {"rollouts": n, "env_steps_per_s": steps / seconds, "shares": _shares(after)}
            if n == 2:
                point["takeover"] = takeover(meter, "rollout-1", "rollout-0")
        points.append(point)
    single = points[0]["env_steps_per_s"] / points[0]["rollouts"]
    for point in points:
        point["efficiency_vs_linear"] = (
            point["env_steps_per_s"] / (single * point["rollouts"]) if single else None
        )
    return {
        "env_id": env_id,
        "inference_delay_s_per_batch": delay_s,
        "env_services": ROLLOUT_SCALING_SERVICES,
        "instances_per_service": ROLLOUT_SCALING_INSTANCES,
        "sessions_per_env": ROLLOUT_SCALING_SLOTS,
        "points": points,
    }


def _shares(steps: dict[str, int]) -> dict[str, float]:
    total = sum(steps.values())
    return {name: round(n / total, 3) for name, n in sorted(steps.items())} if total else {}


def takeover(meter: ServicesMeter, victim: str, survivor: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """SIGKILL rollout ``victim`` while it collects: the seconds until ``survivor`` holds every instance (in its
    registry entry, which lags by up to a heartbeat), and the longest time the run's env steps stood still."""
    meter.resume()
    try:
        instances = sum(f.get("instances_held", 0) for f in meter.services("rollout").values())
        killed_at = last_move = time.monotonic()
        last_steps, longest_stall, taken_over_s = meter.steps(), 0.0, None
        meter.child(victim).process.kill()
        while (now := time.monotonic()) - killed_at < timeout_s:
            time.sleep(TAKEOVER_POLL_S)
            if (steps := meter.steps()) != last_steps:
                longest_stall, last_move, last_steps = max(longest_stall, now - last_move), now, steps
            held = meter.services("rollout").get(survivor, {}).get("instances_held", 0)
            if taken_over_s is None and held == instances:
                taken_over_s = now - killed_at
            if taken_over_s is not None and now - killed_at > taken_over_s + 1.0:
                break
        return {
            "taken_over_s": None if taken_over_s is None else round(taken_over_s, 2),
            "longest_stall_s": round(max(longest_stall, time.monotonic() - last_move), 2),
            "instances": instances,
        }
    finally:
        meter.pause()
