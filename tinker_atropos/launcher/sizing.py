"""``auto`` for ``env.services``, ``env.instances`` and ``rollout.replicas``: the run sized from the cores it may use
and what a step costs, so that one config fills a 2-core laptop and a 16-core box alike.

The rule (docs/scaling.md, "Sizing a run to the machine"), with the figures behind it:

- The cores: this process's CPU affinity, capped by a cgroup CPU quota (a container's ``--cpus``). From 4 cores
  up, one is left to the trainer and Valkey; below that they share the cores with the rest.
- ``e``, the CPU time of one env step of one instance, is measured here at start: 8 instances of the configured
  env and backend stepped with random actions on one thread for at most 0.2 s of CPU.
- ``env.instances``: a batch step of about ``BATCH_US`` of simulation, so that what every message costs the env
  service and the rollout beside the simulation stays small against it: round(BATCH_US / e), within 4 and 64.
  4 ms is where 2 env services of 8 Humanoids on this project's 2-core machine collected fastest (configs/humanoid.yaml).
- CPU per env step in each process, at n instances per session: the env service ``e + ENV_MESSAGE_US / n``, the
  rollout ``ROLLOUT_INSTANCE_US + ROLLOUT_MESSAGE_US / n``. From the profiles of docs/benchmarks.md (2 cores, Humanoid,
  n = 8: rollout 105 µs per step, 20 % of it the policy's layers; env services 600 µs per step of their own, 390
  of it ``mj_step``) and a 16-core run (n = 4: rollout 120 µs per step).
- The cores go to env services and rollouts in that proportion: ``rollout.replicas`` = ceil(cores x rollout share
  / 0.75), a rollout process being one Python thread at a time that the measured runs saw at most ~0.75 busy
  while it kept up, and at most as many as there are session slots; ``env.services`` = round(cores x env share /
  ``env.threads``), at least 1.

Humanoid-v5 (e ~ 450 µs here): 2 cores -> 2 env services of 9, 1 rollout; 16 cores -> 13 services of 7-8, 3
rollouts (the hand-made 16-core config had 12 of 4 and 3). CartPole-v1 (e ~ 10 µs): 2 cores -> 1 service of 64
and 1 rollout. Numbers given in the config are kept, and the others are sized around them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tinker_atropos.config import Config, EnvSection

AUTO = "auto"
BATCH_US = 4000.0
MIN_INSTANCES, MAX_INSTANCES = 4, 64
ENV_MESSAGE_US = 400.0
ROLLOUT_INSTANCE_US = 20.0
ROLLOUT_MESSAGE_US = 500.0
ROLLOUT_CORE_SHARE = 0.75
RESERVE_FROM_CORES = 4  # from this many cores up, one is left to the trainer and Valkey
MEASURE_CPU_S = 0.2
MEASURE_INSTANCES = 8


def usable_cores() -> float:
    """The cores this process may run on: its affinity, capped by a cgroup v2 or v1 CPU quota."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = _cgroup_quota()
    return min(cores, quota) if quota else cores


def _cgroup_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def env_step_us(env: EnvSection) -> float:
    """CPU µs of one env step of one instance: ``MEASURE_INSTANCES`` instances stepped with random actions on one
    thread, until ``MEASURE_CPU_S`` of CPU or 500 batch steps."""
    import gymnasium as gym

    from tinker_atropos.environment.backends.base import make_env_batch

    batch = make_env_batch(env.backend, env.id, env.kwargs, MEASURE_INSTANCES, 1)
    try:
        batch.reset(0)
        actions = gym.vector.utils.batch_space(batch.action_space, MEASURE_INSTANCES)
        actions.seed(0)
        batch.step(actions.sample())  # the first step warms caches
        start, steps = time.process_time(), 0
        while steps < 500 and time.process_time() - start < MEASURE_CPU_S:
            batch.step(actions.sample())
            steps += 1
        return max((time.process_time() - start) / (steps * MEASURE_INSTANCES) * 1e6, 1.0)
    finally:
        batch.close()


@dataclass(frozen=True)
class Sizing:
    """What the rule chose, and why, for ``up`` to print in one line."""

    services: int
    instances: int
    replicas: int
    line: str


def size_run(config: Config, cores: float, step_us: float, sessions_per_env: int = 1) -> Sizing:
    """The rule above for ``cores`` and an env step of ``step_us``; the config's numbers are kept."""
    env, rollout = config.env, config.rollout
    n = (
        env.instances
        if env.instances != AUTO
        else min(max(round(BATCH_US / step_us), MIN_INSTANCES), MAX_INSTANCES)
    )
    env_us = step_us + ENV_MESSAGE_US / n
    rollout_us = ROLLOUT_INSTANCE_US + ROLLOUT_MESSAGE_US / n
    rollout_share = rollout_us / (env_us + rollout_us)
    usable = cores - 1 if cores >= RESERVE_FROM_CORES else cores
    services = (
        env.services if env.services != AUTO else max(1, round(usable * (1 - rollout_share) / env.threads))
    )
    replicas = rollout.replicas
    if replicas == AUTO:
        replicas = max(
            1, min(math.ceil(usable * rollout_share / ROLLOUT_CORE_SHARE), services * sessions_per_env)
        )
    line = (
        f"sized for {cores:g} cores{' (1 left to the trainer and Valkey)' if usable < cores else ''}: an env step "
        f"costs {step_us:.0f} µs of CPU, so {services} env service(s) of {n} instances and {replicas} rollout(s) "
        f"(rollouts' share of the CPU per step {rollout_share:.0%})"
    )
    return Sizing(services, n, replicas, line)


def resolve_auto(config: Config) -> None:
    """Replace every ``auto`` of ``config`` by its size for this machine (``size_run``), the line saying what was
    chosen and why kept as ``config.sizing``. EnvError for an env that cannot be stepped."""
    env, rollout = config.env, config.rollout
    if AUTO not in (env.services, env.instances, rollout.replicas):
        return
    from tinker_atropos.environment.check import check_env

    check_env(env)  # an env that cannot be made is one line (EnvError) before it is measured
    sizing = size_run(config, usable_cores(), env_step_us(env), rollout.sessions_per_env)
    env.services, env.instances, rollout.replicas = sizing.services, sizing.instances, sizing.replicas
    config._sizing = sizing.line
