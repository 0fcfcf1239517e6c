"""``python -m bench chaos``: the same run undisturbed and with a random service SIGKILLed every K seconds.

It answers two questions: does learning survive crashes (the two learning curves), and what does each kind of
crash cost (per kill, the seconds until env steps and policy version have both moved past the first report after
the kill, i.e. until the run goes on). The kills come from outside, as a chaos monkey's do: ``ChaosMonkey``
finds the run's service processes itself and `up` supervises them as it would after any crash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.report import machine, package_versions, read_jsonl
from tinker_atropos.config import Config
from tinker_atropos.launcher.progress import RETURN_WINDOW
from tinker_atropos.processes import child_preexec

KINDS = ("env", "rollout", "trainer")
KIND_COLORS = {"env": "tab:green", "rollout": "tab:orange", "trainer": "tab:red"}


@dataclass(frozen=True)
class ChaosOptions:
    total_steps: int = 150_000
    chaos_interval_s: float = 8.0
    out: Path = Path("bench/out")
    report_interval_s: float = 0.5  # the resolution of the recovery times
    timeout_s: float = 1800.0  # per run: a run that stops making progress must not hang the command
    note: str = (
        "measured on a machine shared with other workloads; "
        "recovery times have the resolution of the report interval"
    )


def recovery_times(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each kill event with ``recovery_s``: seconds from the kill to the first metrics row where env steps and
    policy version are both above the highest values reported up to the first row after the kill (None: the
    run ended first).

    Both must rise: env steps alone keep counting while a dead trainer's batch is collected. Counting up to the
    first row after the kill never credits progress made before it (the figure is an upper bound, at the
    resolution of the report interval), and the highest version ignores the 0 reported while no trainer is
    registered: a restarted trainer must publish a version beyond any seen.
    """
    records = []
    for event in events:
        killed_at = event["wall_time_s"]
        after = [r for r in rows if r["wall_time_s"] >= killed_at]
        seen = [r for r in rows if r["wall_time_s"] < killed_at] + after[:1]
        steps = max((r["env_steps"] for r in seen), default=0)
        version = max((r["policy_version"] for r in seen), default=0)
        on = next((r for r in after if r["env_steps"] > steps and r["policy_version"] > version), None)
        recovery = None if on is None else round(on["wall_time_s"] - killed_at, 3)
        records.append(event | {"env_steps": steps, "policy_version": version, "recovery_s": recovery})
    return records


def time_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst recovery of ``records``; kills the run ended before recovering are counted apart."""
    times = [r["recovery_s"] for r in records if r["recovery_s"] is not None]
    return {
        "kills": len(records),
        "not_recovered": len(records) - len(times),
        "median_s": statistics.median(times) if times else None,
        "worst_s": max(times) if times else None,
    }


def recovery_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per killed service kind: each kind fails in its own way, so one figure for all would hide the slow one."""
    return {kind: time_stats([r for r in records if r["kind"] == kind]) for kind in KINDS}


def run_services(run_dir: Path) -> list[tuple[int, str, str]]:
    """(pid, kind, name) of every service process of the `up` run in ``run_dir``, read from /proc: `up` starts
    each with ``tinker_atropos KIND --config RUN_DIR/config.yaml … --name NAME``."""
    config = str(run_dir / "config.yaml")
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = [arg.decode(errors="replace") for arg in cmdline.read_bytes().split(b"\0")]
        except OSError:  # gone meanwhile
            continue
        if "tinker_atropos" not in argv or config not in argv:
            continue
        position = argv.index("tinker_atropos") + 1
        kind = argv[position] if position < len(argv) else ""
        if kind in KINDS and "--name" in argv:
            found.append((int(cmdline.parent.name), kind, argv[argv.index("--name") + 1]))
    return found


class ChaosMonkey(threading.Thread):
    """SIGKILLs a random service of the run in ``run_dir`` every ``interval_s``, as a crashed node or an OOM kill
    would, and appends each kill to ``events`` (unix ``time``, ``service``, ``kind``, ``pid``)."""

    def __init__(self, run_dir: Path, interval_s: float, events: Path, seed: int) -> None:
        super().__init__(name="chaos-monkey", daemon=True)
        self.run_dir, self.interval_s, self.events = run_dir, interval_s, events
        self.rng, self.stop = random.Random(seed), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            victims = run_services(self.run_dir)
            if not victims:
                continue
            pid, kind, name = self.rng.choice(sorted(victims))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # exited between the look and the kill
                continue
            with self.events.open("a") as out:
                out.write(
                    json.dumps({"time": round(time.time(), 3), "service": name, "kind": kind, "pid": pid})
                    + "\n"
                )


def on_metrics_clock(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kill events with ``wall_time_s`` on the clock of metrics.jsonl, from the rows' unix ``time``."""
    if not rows:
        return []
    offset = rows[0]["time"] - rows[0]["wall_time_s"]
    return [event | {"wall_time_s": round(event["time"] - offset, 3)} for event in events]


def run_up(config: Config, work_dir: Path, options: ChaosOptions, chaos: bool) -> dict[str, Any]:
    """One ``tinker-atropos up`` as its own process into a fresh ``work_dir``; its metrics and kill events."""
    shutil.rmtree(work_dir, ignore_errors=True)  # metrics.jsonl is appended to: start from nothing
    work_dir.mkdir(parents=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(config.to_yaml())
    run_dir = work_dir / "run"
    command = [sys.executable, "-m", "tinker_atropos", "up", str(config_path), "--run-dir", str(run_dir)]
    command += ["--total-steps", str(options.total_steps)]
    monkey = ChaosMonkey(run_dir, options.chaos_interval_s, work_dir / "chaos.jsonl", config.run.seed)
    with open(work_dir / "up.log", "w") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
        if chaos:
            monkey.start()
        try:
            code = up.wait(timeout=options.timeout_s)
        finally:
            monkey.stop.set()
            if up.poll() is None:  # timeout or Ctrl-C: drain the run as Ctrl-C would
                up.send_signal(signal.SIGINT)
                up.wait(timeout=30)
    if code != 0:
        raise RuntimeError(f"`tinker-atropos up` exited with {code}; see {work_dir / 'up.log'}")
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "event" not in row]
    return {"rows": rows, "events": on_metrics_clock(read_jsonl(work_dir / "chaos.jsonl"), rows)}


def run_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    last = rows[-1]
    return {
        "env_steps": last["env_steps"],
        "wall_time_s": last["wall_time_s"],
        "env_steps_per_s": round(last["env_steps"] / last["wall_time_s"], 1),
        "final_return_mean": last["episode_return_mean"],
        "policy_version": last["policy_version"],
    }


def draw_curves(runs: dict[str, dict[str, Any]], result: dict[str, Any], out: Path) -> Path | None:
    """Mean return vs env steps and vs wall time for both runs, kills marked; None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for label, run in runs.items():
        rows = [r for r in run["rows"] if r["episode_return_mean"] is not None]
        returns = [r["episode_return_mean"] for r in rows]
        by_steps.plot([r["env_steps"] for r in rows], returns, label=label)
        by_time.plot([r["wall_time_s"] for r in rows], returns, label=label)
    for kill in result["kills"]:
        by_time.axvline(kill["wall_time_s"], color=KIND_COLORS[kill["kind"]], alpha=0.35, lw=1)
    for kind, color in KIND_COLORS.items():
        by_time.plot([], [], color=color, alpha=0.5, label=f"{kind} killed")
    by_steps.set_xlabel("env steps")
    by_steps.set_ylabel(f"mean return, last {RETURN_WINDOW} episodes")
    by_time.set_xlabel("wall time (s)")
    by_steps.legend()
    by_time.legend(fontsize="small")
    c = result["conditions"]
    fig.suptitle(
        f"{c['env_id']}: undisturbed vs a random service SIGKILLed every {c['chaos_interval_s']:g} s "
        f"({result['machine']['cores']} cores)"
    )
    fig.tight_layout()
    path = out / "chaos.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_tables(result: dict[str, Any], console: Console) -> None:
    runs = Table(title=f"{result['conditions']['env_id']}, {result['conditions']['total_steps']:,} env steps")
    for column in ("run", "wall s", "env steps/s", f"final return (last {RETURN_WINDOW})", "kills"):
        runs.add_column(column, justify="right")
    for label, summary in result["runs"].items():
        runs.add_row(
            label,
            f"{summary['wall_time_s']:.1f}",
            f"{summary['env_steps_per_s']:,.0f}",
            f"{summary['final_return_mean']:.1f}",
            str(summary["kills"]),
        )
    console.print(runs)
    recovery = Table(title="recovery: kill → env steps and policy version both rising again")
    for column in ("killed", "kills", "median s", "worst s", "not recovered"):
        recovery.add_column(column, justify="right")
    groups = result["recovery"] | {"nothing (undisturbed run)": result["recovery_undisturbed"]}
    for kind, s in groups.items():
        shown = ["-" if s[k] is None else f"{s[k]:.1f}" for k in ("median_s", "worst_s")]
        recovery.add_row(kind, str(s["kills"]), *shown, str(s["not_recovered"]))
    console.print(recovery)


def run_chaos(config: Config, options: ChaosOptions, console: Console) -> dict[str, Any]:
    """Run undisturbed, then with chaos; write chaos.json and chaos.png under ``options.out``."""
    options.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs = {}
    for label in ("undisturbed", "chaos"):
        run_config = config.model_copy(deep=True)
        run_config.run.name = f"{config.run.name}-{label}"
        run_config.run.report_interval_s = options.report_interval_s
        console.print(f"[bold]{label}[/]: {options.total_steps:,} env steps")
        runs[label] = run_up(run_config, options.out / "chaos-runs" / label, options, label == "chaos")
    kills = recovery_times(runs["chaos"]["rows"], runs["chaos"]["events"])
    undisturbed = runs["undisturbed"]["rows"]
    probes = [e for e in runs["chaos"]["events"] if e["wall_time_s"] < undisturbed[-1]["wall_time_s"]]
    result = {
        "conditions": {
            "env_id": config.env.id,
            "instances": config.env.instances,
            "env_services": config.env.services,
            "rollout_replicas": config.rollout.replicas,
            "checkpoint_every_updates": config.trainer.checkpoint.every_updates,  # what a trainer kill loses
            "total_steps": options.total_steps,
            "chaos_interval_s": options.chaos_interval_s,
            "report_interval_s": options.report_interval_s,
            "kill": "SIGKILL of a uniformly chosen running service; `up` restarts it after 0.5 s",
            "total_wall_s": round(time.monotonic() - started, 1),
            "note": options.note,
        },
        "runs": {
            label: run_summary(run["rows"]) | {"kills": len(run["events"])} for label, run in runs.items()
        },
        "recovery": recovery_summary(kills),
        # the same measure at the same times of the undisturbed run: what it reads with nothing killed
        "recovery_undisturbed": time_stats(recovery_times(undisturbed, probes)),
        "kills": kills,
        "machine": machine(),
        "packages": package_versions(),
    }
    path = options.out / "chaos.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result, console)
    chart = draw_curves(runs, result, options.out)
    console.print(f"wrote {path}" + ("" if chart is None else f", {chart}"))
    return result
