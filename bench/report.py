"""What a benchmark run leaves: one JSON file, a table of figures and ratios, and bar charts."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RATE_KEYS = (
    "limit_steps_per_s",
    "raw_env_steps_per_s",
    "raw_backend_steps_per_s",
    "envpool_steps_per_s",
    "collect_env_steps_per_s",
    "collect_grpc_env_steps_per_s",
    "collect_secure_env_steps_per_s",
    "collect_grpc_secure_env_steps_per_s",
    "train_env_steps_per_s",
    "train_secure_env_steps_per_s",
    "sb3_ppo_steps_per_s",
    "sb3_ppo_subproc_steps_per_s",
    "sample_factory_steps_per_s",
)
RATIOS = {
    # the distance to the machine's physics limit, and what learning costs on top of collection
    "collect/limit": ("collect_env_steps_per_s", "limit_steps_per_s"),
    "train/limit": ("train_env_steps_per_s", "limit_steps_per_s"),
    "train/collect": ("train_env_steps_per_s", "collect_env_steps_per_s"),
    "collect/raw": ("collect_env_steps_per_s", "raw_env_steps_per_s"),
    "collect/envpool": ("collect_env_steps_per_s", "envpool_steps_per_s"),
    "collect/collect_grpc": ("collect_env_steps_per_s", "collect_grpc_env_steps_per_s"),
    "train/sb3": ("train_env_steps_per_s", "sb3_ppo_steps_per_s"),
    "train/sb3_subproc": ("train_env_steps_per_s", "sb3_ppo_subproc_steps_per_s"),
    "train/sample_factory": ("train_env_steps_per_s", "sample_factory_steps_per_s"),
    # what protecting every link costs: 1.0 is free
    "collect_secure/collect": ("collect_secure_env_steps_per_s", "collect_env_steps_per_s"),
    "collect_grpc_secure/collect_grpc": (
        "collect_grpc_secure_env_steps_per_s",
        "collect_grpc_env_steps_per_s",
    ),
    "train_secure/train": ("train_secure_env_steps_per_s", "train_env_steps_per_s"),
}
PACKAGES = (
    "tinker-atropos",
    "gymnasium",
    "mujoco",
    "torch",
    "numpy",
    "grpcio",
    "envpool",
    "stable-baselines3",
)


def machine() -> dict[str, Any]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cores": os.cpu_count(), "cpu_model": model, "platform": platform.platform()}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    def ratio(num: str, den: str) -> float | None:
        a, b = result.get(num), result.get(den)
        return None if a is None or not b else a / b

    return {name: ratio(*keys) for name, keys in RATIOS.items()}


def ratio_ranges(per_round: dict[str, list[float]]) -> dict[str, dict[str, float] | None]:
    """Each ratio taken round by round, its two phases measured seconds apart: min, median and max."""

    def spread(num: str, den: str) -> dict[str, float] | None:
        pairs = list(zip(per_round.get(num, []), per_round.get(den, []), strict=False))
        values = [a / b for a, b in pairs if b]
        if not values:
            return None
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    return {name: spread(*keys) for name, keys in RATIOS.items()}


def print_table(result: dict[str, Any], console: Console) -> None:
    c = result["conditions"]
    table = Table(title=f"{c['env_id']} × {c['instances']} instances, env steps/s ({c['step_convention']})")
    table.add_column("phase")
    table.add_column("env steps/s", justify="right")
    for key in RATE_KEYS:
        value = result[key]
        table.add_row(key, "-" if value is None else f"{value:,.0f}")
    ranges = (result.get("rounds") or {}).get("ratios", {})
    for name, value in result["ratios"].items():
        spread = ranges.get(name)
        per_round = "" if spread is None else f" (rounds {spread['min']:.2f}–{spread['max']:.2f})"
        table.add_row(f"[bold]{name}", "-" if value is None else f"{value:.2f}{per_round}")
    console.print(table)
    train = result.get("train")
    if train:
        lag = train["policy_lag"]
        console.print(
            f"train, nothing paused: {train['unpaused_env_steps_per_s']:,.0f} env steps/s, "
            f"trainer busy {train['trainer_busy']:.0%}, policy lag min/mean/max "
            f"{lag['min']}/{lag['mean']:.2f}/{lag['max']}, CPU µs per env step by service "
            f"{train['cpu_us_per_env_step']}"
            + (
                ""
                if train.get("rollout_cpu_spread") is None
                else f", rollouts max/min {train['rollout_cpu_spread']:.2f}"
            )
        )
        gpu = train.get("gpu")
        if gpu:
            console.print(
                f"GPU: {gpu['unavailable']}"
                if "unavailable" in gpu
                else f"GPU {gpu['index']} ({gpu['name']}): busy {gpu['util_mean']:.0%} on average, {gpu['util_max']:.0%} "
                f"at most; memory {gpu['memory_used_mib_max']:,.0f} MiB at most"
            )
    for phase, reason in (result.get("unavailable") or {}).items():
        console.print(f"{phase}: not measured, {reason}")
    scaling = result.get("scaling")
    if scaling:
        table = Table(title=f"collection scaling, {scaling['env_id']} ({scaling['wrapped_env_id']})")
        for column in ("env services", "env steps/s", "efficiency vs linear", "vs latency bound"):
            table.add_column(column, justify="right")
        for p in scaling["points"]:
            bound = p.get("efficiency_vs_latency_bound")
            table.add_row(
                str(p["env_services"]),
                f"{p['env_steps_per_s']:,.0f}",
                f"{p['efficiency_vs_linear']:.0%}",
                "-" if bound is None else f"{bound:.0%}",
            )
        console.print(table)
    rollouts = result.get("rollout_scaling")
    if rollouts:
        table = Table(
            title=f"rollout scaling, {rollouts['env_id']}, {rollouts['inference_delay_s_per_batch'] * 1000:g} ms "
            f"acting per batch, {rollouts['env_services']} env services"
        )
        for column in ("rollouts", "env steps/s", "efficiency vs linear", "shares", "SIGKILL of one"):
            table.add_column(column, justify="right")
        for p in rollouts["points"]:
            kill = p.get("takeover")
            table.add_row(
                str(p["rollouts"]),
                f"{p['env_steps_per_s']:,.0f}",
                f"{p['efficiency_vs_linear']:.0%}",
                " ".join(f"{share:.0%}" for share in p["shares"].values()),
                ""
                if kill is None
                else f"taken over {kill['taken_over_s']} s, longest stall {kill['longest_stall_s']} s",
            )
        console.print(table)


def draw_charts(result: dict[str, Any], out: Path) -> list[Path]:
    """Bar chart of the phases (and the scaling curve); nothing without matplotlib (the ``bench`` extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["conditions"]
    measured = [(k.removesuffix("_steps_per_s"), result[k]) for k in RATE_KEYS if result[k] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar([name for name, _ in measured], [value for _, value in measured], color="tab:blue")
    ax.bar_label(bars, fmt="{:,.0f}")
    ax.set_ylabel("env steps/s (MuJoCo: 1 step = 5 physics steps)")
    ax.set_title(f"{c['env_id']} × {c['instances']} instances, {result['machine']['cores']} cores")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    paths = [out / "bench.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    scaling = result.get("scaling")
    if scaling:
        title = (
            f"{scaling['wrapped_env_id']} + {scaling['delay_s_per_batch_step'] * 1000:g} ms per batch step, "
            f"{scaling['instances_per_service']} instances/service"
        )
        paths.append(scaling_chart(scaling["points"], "env_services", title, out / "scaling.png", log2=True))
    rollouts = result.get("rollout_scaling")
    if rollouts:
        title = (
            f"{rollouts['env_id']}, {rollouts['inference_delay_s_per_batch'] * 1000:g} ms acting per batch, "
            f"{rollouts['env_services']} env services"
        )
        paths.append(scaling_chart(rollouts["points"], "rollouts", title, out / "rollout-scaling.png"))
    return paths


def scaling_chart(points: list[dict[str, Any]], key: str, title: str, path: Path, log2: bool = False) -> Path:
    """Env steps/s against the count of ``key`` (env services, rollouts), beside linear from the first point,
    each point labelled with its share of linear (after draw_charts chose matplotlib's backend)."""
    import matplotlib.pyplot as plt

    counts = [p[key] for p in points]
    single = points[0]["env_steps_per_s"] / counts[0]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(counts, [p["env_steps_per_s"] for p in points], "o-", label="measured")
    ax.plot(counts, [single * n for n in counts], "--", color="gray", label="linear")
    for p in points:
        ax.annotate(f"{p['efficiency_vs_linear']:.0%}", (p[key], p["env_steps_per_s"]))
    if log2:
        ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel(key.replace("_", " "))
    ax.set_ylabel("env steps/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (metrics.jsonl, chaos.jsonl); none when it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(result: dict[str, Any], out: Path) -> Path:
    path = out / "bench.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
