"""Runs the selected phases, never two at once (they would share the CPUs), and reports.

Phases that are compared are set up together and measured in alternating slices, round after round: on a
shared machine whose speed drifts by a third within minutes, a ratio of two phases measured minutes apart
says more about the drift than about the phases. Two groups alternate so: the env steppers (the physics
limit, raw, envpool, collect, collect_grpc), then the learners (train, SB3 PPO on DummyVecEnv and on
SubprocVecEnv, Sample Factory). The trainer's own figures come from a window after
the rounds in which nothing is paused; the scaling curves (env services, then rollouts) run last, alone.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from bench import phases, report, sf_peer
from tinker_atropos.config import Config

ALL_PHASES = (
    "limit",
    "raw",
    "envpool",
    "collect",
    "collect_grpc",
    "collect_secure",
    "collect_grpc_secure",
    "train",
    "train_secure",
    "sb3",
    "sb3_subproc",
    "sample_factory",
    "scaling",
)
# A phase and its "_secure" twin (token, mutual TLS, Redis password, signed records) alternate in one group.
INTERLEAVED_GROUPS = (
    ("limit", "raw", "envpool", "collect", "collect_grpc", "collect_secure", "collect_grpc_secure"),
    ("train", "train_secure", "sb3", "sb3_subproc", "sample_factory"),
)
# Why a selected phase has no figure, when the meter finds it cannot run here (Sample Factory says its own).
UNAVAILABLE = {
    "limit": "the physics limit steps the mujoco backend's envs only (it takes their reset rule)",
    "envpool": "EnvPool is not installed or has no such env id",
    "sb3": "stable-baselines3 is not installed (the bench extra)",
    "sb3_subproc": "stable-baselines3 is not installed (the bench extra)",
}
STEP_CONVENTION = "one step = one env.step of one instance = 5 physics steps for MuJoCo locomotion"


@dataclass(frozen=True)
class BenchOptions:
    phases: tuple[str, ...]
    timing: phases.Timing
    out: Path
    scaling_services: tuple[int, ...] = (1, 2, 4, 8)
    scaling_delay_s: float = 0.02  # a remote simulator's round trip, e.g. one 50 Hz game-engine tick
    scaling_env_id: str = "Pendulum-v1"
    scaling_rollouts: tuple[int, ...] = (1, 2, 4)
    scaling_inference_delay_s: float = 0.02  # a rollout's acting per batch: a big policy on its CPU core
    note: str = (
        "measured on a machine shared with other workloads: absolute figures are noisy, ratios less so"
    )

    def __post_init__(self) -> None:
        unknown = set(self.phases) - set(ALL_PHASES)
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)}; allowed: {', '.join(ALL_PHASES)}")


def run_benchmark(config: Config, options: BenchOptions, console: Console) -> dict[str, Any]:
    """Measure each selected phase; unselected or unavailable ones are null. Writes JSON and charts."""
    timing = options.timing
    result: dict[str, Any] = {key: None for key in report.RATE_KEYS}
    result |= {"train": None, "scaling": None, "rollout_scaling": None, "unavailable": {}}
    options.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-", dir=options.out) as scratch:
        work = Path(scratch)
        slices: dict[str, list[tuple[int, float]]] = {}
        for group in INTERLEAVED_GROUPS:
            group_slices, train_figures = _interleaved_slices(
                config, options, group, work, console, result["unavailable"]
            )
            slices |= group_slices
            if train_figures is not None:
                result["train"] = train_figures
        for key, measured in slices.items():
            result[key] = sum(steps for steps, _ in measured) / sum(seconds for _, seconds in measured)
        if "scaling" in options.phases:
            console.print(
                f"[bold]phase scaling[/] (warm-up {timing.warmup_s:g}s, window {timing.window_s:g}s)"
            )
            result["scaling"] = phases.scaling_curve(
                config,
                timing,
                list(options.scaling_services),
                options.scaling_delay_s,
                options.scaling_env_id,
                work / "scaling",
            )
            result["rollout_scaling"] = phases.rollout_scaling_curve(
                config,
                timing,
                list(options.scaling_rollouts),
                options.scaling_inference_delay_s,
                options.scaling_env_id,
                work / "rollout-scaling",
            )
    result["ratios"] = report.ratios(result)
    per_round = {key: [steps / seconds for steps, seconds in measured] for key, measured in slices.items()}
    result["rounds"] = {"steps_per_s": per_round, "ratios": report.ratio_ranges(per_round)}
    result["conditions"] = {
        "env_id": config.env.id,
        "instances": config.env.total_instances,
        "backend": config.env.backend,
        "env_services": config.env.services,
        "rollout_replicas": config.rollout.replicas,
        "sessions_per_env": config.rollout.sessions_per_env,
        "transport": config.rollout.transport,
        "phases": [p for p in ALL_PHASES if p in options.phases],
        "warmup_s": timing.warmup_s,
        "window_s": timing.window_s,
        "rounds": timing.rounds,
        "slice_s": timing.slice_s,
        "settle_s": phases.SETTLE_S,
        "step_convention": STEP_CONVENTION,
        "total_wall_s": round(time.monotonic() - started, 1),
        "note": options.note,
    }
    result["machine"] = report.machine()
    result["packages"] = report.package_versions()
    path = report.write_json(result, options.out)
    report.print_table(result, console)
    charts = report.draw_charts(result, options.out)
    console.print(f"wrote {path}" + "".join(f", {p}" for p in charts))
    return result


def _interleaved_slices(
    config: Config,
    options: BenchOptions,
    group: tuple[str, ...],
    work: Path,
    console: Console,
    unavailable: dict[str, str],
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any] | None]:
    """Set up the selected phases of ``group``, then measure them in alternating slices
    (``interleaved_rates``): (env steps, seconds) per slice keyed by the result key, and the trainer's
    figures when ``train`` is among them. A phase that cannot run here is left out, its reason put in
    ``unavailable``."""
    timing = options.timing
    with ExitStack() as stack:
        meters: dict[str, phases.Meter] = {}
        for phase in (p for p in group if p in options.phases):
            console.print(f"[bold]setting up {phase}[/] (warm-up {timing.warmup_s:g}s)")
            meter: phases.Meter | None
            if phase == "limit":
                key, meter = "limit_steps_per_s", stack.enter_context(phases.limit_meter(config, timing))
            elif phase == "sample_factory":
                key = "sample_factory_steps_per_s"
                meter = stack.enter_context(phases.sample_factory_meter(config, timing, work / phase))
            elif phase.startswith("sb3"):
                subprocesses = phase == "sb3_subproc"
                key = "sb3_ppo_subproc_steps_per_s" if subprocesses else "sb3_ppo_steps_per_s"
                meter = stack.enter_context(phases.sb3_meter(config, timing, subprocesses))
            elif phase == "raw":
                if config.env.backend != "gymnasium":  # else it would measure the same thing again
                    meters["raw_backend_steps_per_s"] = stack.enter_context(
                        phases.raw_meter(config, timing, config.env.backend)
                    )
                key, meter = "raw_env_steps_per_s", stack.enter_context(phases.raw_meter(config, timing))
            elif phase == "envpool":
                key, meter = "envpool_steps_per_s", stack.enter_context(phases.envpool_meter(config, timing))
            else:  # collect and train; collect_grpc: the local fast path switched off
                transport = "grpc" if "grpc" in phase else None
                learn, secure = phase.startswith("train"), phase.endswith("_secure")
                key = f"{phase}_env_steps_per_s"
                meter = stack.enter_context(
                    phases.services_meter(
                        config, timing, work / phase, transport=transport, learn=learn, secure=secure
                    )
                )
            if meter is None:
                unavailable[phase] = UNAVAILABLE.get(phase) or sf_peer.unavailable(config) or "?"
            else:
                meters[key] = meter
        if not meters:
            return {}, None
        console.print(
            f"[bold]measuring {', '.join(meters)}[/]: {timing.rounds} round(s) of {timing.slice_s:g}s slices, "
            f"each after {phases.SETTLE_S:g}s unmeasured"
        )
        slices = phases.interleaved_rates(meters, timing)
        train = meters.get("train_env_steps_per_s")
        if not isinstance(train, phases.TrainMeter):
            return slices, None
        console.print(
            f"[bold]trainer figures[/]: {max(timing.warmup_s, timing.figures_run_in_s):g}s run-in, "
            f"{timing.window_s:g}s window, nothing paused"
        )
        return slices, train.figures(timing)
