"""Learning under a wall-clock budget: our whole system against Stable-Baselines3 on the same machine.

Throughput means nothing if the policy learns less, so this measures what a user gets: the mean return of the
latest episodes after the same wall time (start-up included) for each system and seed, run one after the other
so that they never share the CPUs. SB3 runs the config's algorithm, set up as our trainer: PPO
(``phases.sb3_ppo``: same batch, epochs and hyper-parameters, observations and returns normalised) for ppo and
appo, SAC (``phases.sb3_sac``: same network, batch, buffer and update-to-data ratio) for sac. Sample Factory's
APPO (``sf_appo_sync``, ``sf_appo_async``: its ``async_rl`` off, as its tuned MuJoCo defaults, and on) runs
from its own venv (``bench/.venv-sf``, made by ``make bench-learn``) with those defaults and the config's
instance count. ``tinker_atropos@CONFIG`` runs ours once more with another config (another algorithm on the
same task, e.g. ``tinker_atropos@configs/humanoid.yaml`` beside an APPO config), with the same seeds and budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import report
from bench.phases import sb3_ppo, sb3_sac
from bench.sf_peer import SF_ENV_VERSION, sf_command
from bench.throughput import STEP_CONVENTION
from tinker_atropos.config import Config, load_config
from tinker_atropos.launcher.progress import RETURN_WINDOW
from tinker_atropos.processes import child_preexec

SYSTEMS = ("tinker_atropos", "sb3_ppo", "sb3_sac", "sf_appo_sync", "sf_appo_async")
OURS_WITH = "tinker_atropos@"  # + a config path: ours with that config, beside the benchmark's own
SB3_BUILDERS = {"sb3_ppo": sb3_ppo, "sb3_sac": sb3_sac}


def sb3_peer(config: Config) -> str:
    """The SB3 system a config is compared with: SAC for sac, PPO otherwise (APPO's nearest in SB3)."""
    return "sb3_sac" if config.trainer.algorithm == "sac" else "sb3_ppo"


FINAL_FRACTION_START = 0.9  # the final return averages the curve over the last tenth of the budget


@dataclass(frozen=True)
class LearnOptions:
    budget_s: float
    seeds: int
    out: Path
    report_interval_s: float = 5.0
    systems: tuple[str, ...] | None = None  # None: ours and the config's SB3 peer (``sb3_peer``)

    def __post_init__(self) -> None:
        unknown = {s for s in self.systems or () if s not in SYSTEMS and not s.startswith(OURS_WITH)}
        if unknown:
            raise ValueError(
                f"unknown systems {sorted(unknown)}; allowed: {', '.join(SYSTEMS)}, {OURS_WITH}CONFIG"
            )
        for system in self.systems or ():
            if system.startswith(OURS_WITH):
                load_config(system[len(OURS_WITH) :])  # a missing or bad config now, not an hour in


def _point(
    wall_time_s: float, env_steps: int, episode_return_mean: float | None, trainer_busy: float | None = None
) -> dict[str, Any]:
    point = {
        "wall_time_s": round(wall_time_s, 2),
        "env_steps": int(env_steps),
        "episode_return_mean": episode_return_mean,
    }
    if trainer_busy is not None:
        point["trainer_busy"] = trainer_busy
    return point


def _wait_or_interrupt(process: subprocess.Popen, timeout_s: float) -> int:
    """The exit code of ``process``, interrupted (then killed, with its group) when it outlives ``timeout_s``."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait()


def ours(config: Config, budget_s: float, work_dir: Path) -> list[dict[str, Any]]:
    """``tinker-atropos up`` for ``budget_s`` of wall time; its metrics.jsonl is the curve."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    command = [sys.executable, "-m", "tinker_atropos", "up", str(config_path)]
    command += ["--run-dir", str(work_dir / "run"), "--max-seconds", str(budget_s), "--fresh"]
    with open(work_dir / "up.log", "w") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
        code = _wait_or_interrupt(up, budget_s + 120)
    if code != 0:
        raise RuntimeError(f"`tinker-atropos up` exited with code {code}; see {work_dir / 'up.log'}")
    rows = report.read_jsonl(work_dir / "run" / "metrics.jsonl")
    return [
        _point(r["wall_time_s"], r["env_steps"], r["episode_return_mean"], r.get("trainer_busy"))
        for r in rows
    ]


def sample_factory(
    system: str, config: Config, budget_s: float, report_interval_s: float, work_dir: Path
) -> list[dict[str, Any]]:
    """Sample Factory's APPO (``sf_appo_sync`` or ``sf_appo_async``) for ``budget_s``, start-up included."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = sf_command(config, budget_s, report_interval_s, work_dir, async_rl=system == "sf_appo_async")
    with open(work_dir / "sf.log", "w") as log:
        sf = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        code = _wait_or_interrupt(sf, budget_s + 120)
    if code != 0 or not (work_dir / "curve.jsonl").exists():
        raise RuntimeError(f"Sample Factory exited with code {code}; see {work_dir / 'sf.log'}")
    return report.read_jsonl(work_dir / "curve.jsonl")


def sb3(
    system: str, config: Config, budget_s: float, report_interval_s: float
) -> list[dict[str, Any]] | None:
    """SB3's ``learn()`` (``system``: sb3_ppo or sb3_sac) for ``budget_s`` of wall time, model set-up included;
    None without SB3."""
    try:
        from stable_baselines3.common.callbacks import BaseCallback
    except ImportError:
        return None
    start = time.monotonic()
    model = SB3_BUILDERS[system](config)
    curve: list[dict[str, Any]] = []

    class Budget(BaseCallback):
        """Samples the curve every report interval and stops ``learn()`` when the budget is spent."""

        def __init__(self) -> None:
            super().__init__()
            self.next_report = start + report_interval_s

        def _on_step(self) -> bool:
            now = time.monotonic()
            if now >= self.next_report or now - start >= budget_s:
                self.next_report += report_interval_s
                latest = [e["r"] for e in list(self.model.ep_info_buffer)[-RETURN_WINDOW:]]
                curve.append(
                    _point(now - start, self.num_timesteps, float(np.mean(latest)) if latest else None)
                )
            return now - start < budget_s

    try:
        model.learn(total_timesteps=10**12, callback=Budget())
    finally:
        model.get_env().close()
    return curve


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    finals = [r["final_return"] for r in runs if r["final_return"] is not None]
    busy = [r["trainer_busy_mean"] for r in runs if r["trainer_busy_mean"] is not None]
    if not finals:
        return None
    return {
        "final_return_mean": float(np.mean(finals)),
        "final_return_min": float(np.min(finals)),
        "final_return_max": float(np.max(finals)),
        "env_steps_mean": float(np.mean([r["env_steps"] for r in runs])),
        "env_steps_per_s_mean": float(np.mean([r["env_steps_per_s"] for r in runs])),
        "trainer_busy_mean": float(np.mean(busy)) if busy else None,
        "seeds": len(runs),
    }


def _against(ours_s: dict[str, Any] | None, peer_s: dict[str, Any] | None) -> dict[str, Any] | None:
    """Ours against one peer: return difference, and ratios where they mean something (positive returns)."""
    if not ours_s or not peer_s:
        return None
    ours_r, peer_r = ours_s["final_return_mean"], peer_s["final_return_mean"]
    return {
        "return_difference": ours_r - peer_r,
        "return_ratio": ours_r / peer_r if ours_r > 0 and peer_r > 0 else None,
        "env_steps_per_s_ratio": ours_s["env_steps_per_s_mean"] / peer_s["env_steps_per_s_mean"],
    }


def _run(seed: int, curve: list[dict[str, Any]], budget_s: float) -> dict[str, Any]:
    """One run's curve and its final return: the mean of its points over the last tenth of the budget, since
    one point (the latest 10 episodes) swings by hundreds on Humanoid."""
    returns = [p["episode_return_mean"] for p in curve if p["episode_return_mean"] is not None]
    tail = [
        p["episode_return_mean"]
        for p in curve
        if p["wall_time_s"] >= FINAL_FRACTION_START * budget_s and p["episode_return_mean"] is not None
    ]
    busy = [p["trainer_busy"] for p in curve if p.get("trainer_busy") is not None]
    return {
        "seed": seed,
        "final_return": float(np.mean(tail)) if tail else (returns[-1] if returns else None),
        "last_return": returns[-1] if returns else None,
        "env_steps": curve[-1]["env_steps"] if curve else 0,
        "env_steps_per_s": curve[-1]["env_steps"] / curve[-1]["wall_time_s"] if curve else 0.0,
        "trainer_busy_mean": float(np.mean(busy)) if busy else None,
        "curve": curve,
    }


def run_learning_benchmark(config: Config, options: LearnOptions, console: Console) -> dict[str, Any]:
    """Each seed: every chosen system in the order given, each for the budget. bench-learn.json is rewritten
    after every run, so a failed or interrupted system loses no other's figures; a system that fails is
    recorded with its error and the next one runs. Draws the chart at the end."""
    options.out.mkdir(parents=True, exist_ok=True)
    chosen = options.systems or ("tinker_atropos", sb3_peer(config))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    errors: dict[str, str] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-learn-", dir=options.out) as scratch:
        for k in range(options.seeds):
            for name in runs:
                base = load_config(name[len(OURS_WITH) :]) if name.startswith(OURS_WITH) else config
                cfg = base.model_copy(deep=True)
                cfg.run.seed = config.run.seed + k
                cfg.run.report_interval_s = options.report_interval_s
                console.print(f"[bold]{name}[/] seed {cfg.run.seed}: {options.budget_s:g} s of wall time")
                work_dir = Path(scratch) / f"{name.replace('/', '_')}-seed{cfg.run.seed}"
                try:
                    if name == "tinker_atropos" or name.startswith(OURS_WITH):
                        curve = ours(cfg, options.budget_s, work_dir)
                    elif name.startswith("sf_"):
                        curve = sample_factory(
                            name, cfg, options.budget_s, options.report_interval_s, work_dir
                        )
                    else:
                        curve = sb3(name, cfg, options.budget_s, options.report_interval_s)
                except Exception as error:  # one system failing must not lose the others' hours
                    errors[f"{name}-seed{cfg.run.seed}"] = f"{type(error).__name__}: {error}"
                    console.print(f"[red]{name} seed {cfg.run.seed} failed[/]: {error}")
                    curve = None
                if curve is not None:
                    runs[name].append(_run(cfg.run.seed, curve, options.budget_s))
                result = _result(config, options, runs, errors, time.monotonic() - started)
                (options.out / "bench-learn.json").write_text(json.dumps(result, indent=2) + "\n")
    path = options.out / "bench-learn.json"
    _print_table(result, console)
    chart = _draw_curves(result, options.out / "bench-learn.png")
    console.print(f"wrote {path}" + (f", {chart}" if chart else ""))
    return result


def _result(
    config: Config,
    options: LearnOptions,
    runs: dict[str, list[dict[str, Any]]],
    errors: dict[str, str],
    wall_s: float,
) -> dict[str, Any]:
    """bench-learn.json's content for the runs made so far."""
    summary = {name: _summary(system_runs) for name, system_runs in runs.items()}
    peer = next((name for name in runs if name != "tinker_atropos"), None)
    ours_s, peer_s = summary.get("tinker_atropos"), summary.get(peer) if peer else None
    return {
        "budget_s": options.budget_s,
        "algorithm": config.trainer.algorithm,
        "runs": runs,
        "summary": summary,
        "errors": errors,
        "peer": peer,
        # ours minus the peer's final return (a ratio means nothing for returns below zero, as Pendulum's)
        "return_difference": ours_s["final_return_mean"] - peer_s["final_return_mean"]
        if ours_s and peer_s
        else None,
        "against_peers": {
            name: _against(ours_s, s) for name, s in summary.items() if name != "tinker_atropos"
        },
        "conditions": {
            "env_id": config.env.id,
            "instances": config.env.total_instances,
            "backend": config.env.backend,
            "seeds": options.seeds,
            "return_window_episodes": RETURN_WINDOW,
            "final_return": "mean of the curve's points over the last tenth of the budget",
            "step_convention": STEP_CONVENTION,
            **(
                {"sample_factory_env": f"{config.env.id.split('-v')[0]}-{SF_ENV_VERSION}"}
                if any(name.startswith("sf_") for name in runs)
                else {}
            ),
            "total_wall_s": round(wall_s, 1),
            "note": "systems run one after the other, never together; start-up counts against the budget",
        },
        "machine": report.machine(),
        "packages": report.package_versions(),
    }


def _print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{result['conditions']['env_id']}: mean return after {result['budget_s']:g} s")
    for column in ("system", "seeds", "final return (mean)", "min", "max", "env steps (mean)", "steps/s"):
        table.add_column(column)
    for name, s in result["summary"].items():
        if s is None:
            table.add_row(name, "0", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            name,
            str(s["seeds"]),
            f"{s['final_return_mean']:.1f}",
            f"{s['final_return_min']:.1f}",
            f"{s['final_return_max']:.1f}",
            f"{s['env_steps_mean']:,.0f}",
            f"{s['env_steps_per_s_mean']:,.0f}",
        )
    console.print(table)


def _draw_curves(result: dict[str, Any], path: Path) -> Path | None:
    """Mean return against wall time, one line per system and seed; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for color, name in zip(
        ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"), result["runs"], strict=False
    ):
        for i, run in enumerate(result["runs"][name]):
            points = [p for p in run["curve"] if p["episode_return_mean"] is not None]
            ax.plot(
                [p["wall_time_s"] / 60 for p in points],
                [p["episode_return_mean"] for p in points],
                color=color,
                alpha=0.9 if i == 0 else 0.5,
                label=name if i == 0 else None,
            )
    ax.set_xlabel("wall time (minutes, start-up included)")
    ax.set_ylabel(f"mean return, last {RETURN_WINDOW} episodes")
    ax.set_title(f"{result['conditions']['env_id']}, {result['conditions']['instances']} instances")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
