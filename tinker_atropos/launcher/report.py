"""``tinker-atropos report RUN_DIR``: the run's learning curve, throughput, policy lag and trainer busy over its
wall time, drawn from ``metrics.jsonl`` (the rows ``up`` writes every ``run.report_interval_s``) to one PNG.
Resumed runs continue on the same axes: ``up`` carries the wall time and the counters over."""

from __future__ import annotations

from pathlib import Path

from tinker_atropos.errors import FatalError
from tinker_atropos.launcher.run_folder import metric_rows

PANELS = (  # (row key, title, y label), each against wall time but the first
    ("episode_return_mean", "learning curve", "mean return of the last 10 episodes"),
    ("env_steps_per_s", "throughput", "env steps/s"),
    ("policy_lag_mean", "policy lag", "versions behind, mean"),
    ("trainer_busy", "trainer busy", "fraction of wall time updating"),
)


def draw_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG (default RUN_DIR/report.png); FatalError when the folder holds no report row."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = metric_rows(run_dir / "metrics.jsonl")
    if not rows:
        raise FatalError(f"no report rows in {run_dir / 'metrics.jsonl'}: `tinker-atropos up` writes them")
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for axis, (key, title, label) in zip(axes.flat, PANELS, strict=True):
        points = [
            (r["env_steps"] if key == "episode_return_mean" else r["wall_time_s"], r.get(key)) for r in rows
        ]
        points = [(x, y) for x, y in points if y is not None]
        axis.plot([x for x, _ in points], [y for _, y in points], color="tab:blue")
        axis.set(
            title=title, ylabel=label, xlabel="env steps" if key == "episode_return_mean" else "wall time (s)"
        )
        axis.grid(alpha=0.3)
        if not points:
            axis.text(0.5, 0.5, "not reported", transform=axis.transAxes, ha="center", va="center")
    last = rows[-1]
    figure.suptitle(
        f"{run_dir.name}: {last['env_steps']:,} env steps in {last['wall_time_s']:.0f} s, "
        f"policy version {last.get('policy_version')}"
    )
    path = out or run_dir / "report.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
