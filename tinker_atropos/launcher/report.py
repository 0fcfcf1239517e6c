"""``tinker-atropos report RUN_DIR``: the run's learning curve, throughput, policy lag and trainer busy over its
wall time, drawn from ``metrics.jsonl`` (the rows ``up`` writes every ``run.report_interval_s``) to one PNG, in the
run's words (``RunWords``: a language model's reward of its answers against tokens, and its sampler–learner KL in
place of a policy lag it does not measure), the curve's window the one its ``config.yaml`` sets. Resumed runs
continue on the same axes: ``up`` carries the wall time and the counters over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tinker_atropos.errors import FatalError
from tinker_atropos.launcher.lm_eval import draw_evaluations
from tinker_atropos.launcher.progress import RETURN_WINDOW, RunWords
from tinker_atropos.launcher.run_folder import metric_rows

Panel = tuple[str, str, str]  # (row key, or "losses/<figure>", title, y label)


def panels(words: RunWords, window: int) -> tuple[Panel, ...]:
    """The four panels, each against wall time but the first (against the run's steps)."""
    lag: Panel = ("policy_lag_mean", "policy lag", "versions behind, mean")
    if not words.lag:
        lag = ("losses/kl_sampler_learner", "sampler and learner apart", "KL(sampler || learner) per token")
    return (
        ("episode_return_mean", "learning curve", f"mean {words.ret} of the {words.window(window)}"),
        ("env_steps_per_s", "throughput", f"{words.steps}/s"),
        lag,
        ("trainer_busy", "trainer busy", "fraction of wall time updating"),
    )


def run_settings(run_dir: Path) -> tuple[RunWords, int]:
    """The run's words and return window, read from the ``config.yaml`` ``up`` wrote (plain YAML: a config of an
    earlier version reads too); a control run's and the default window without one."""
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.exists() else None
    language_model = bool(_section(config, "trainer", "atropos").get("enabled", False))
    return RunWords.of(language_model), int(_section(config, "run").get("return_window", RETURN_WINDOW))


def _section(config: Any, *names: str) -> dict[str, Any]:
    """``config[names[0]][names[1]]...``; {} where one is missing or not a mapping."""
    for name in names:
        config = config.get(name) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


def _value(row: dict[str, Any], key: str) -> float | None:
    """A panel's figure in a row: a row key, or ``losses/<name>`` of the trainer's latest figures."""
    if key.startswith("losses/"):
        return (row.get("losses") or {}).get(key.removeprefix("losses/"))
    return row.get(key)


def draw_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG (default RUN_DIR/report.png); FatalError when the folder holds no report row."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = metric_rows(run_dir / "metrics.jsonl")
    if not rows:
        raise FatalError(f"no report rows in {run_dir / 'metrics.jsonl'}: `tinker-atropos up` writes them")
    words, window = run_settings(run_dir)
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for axis, (key, title, label) in zip(axes.flat, panels(words, window), strict=True):
        curve = key == "episode_return_mean"
        points = [(r["env_steps"] if curve else r["wall_time_s"], _value(r, key)) for r in rows]
        points = [(x, y) for x, y in points if y is not None]
        axis.plot([x for x, _ in points], [y for _, y in points], color="tab:blue")
        axis.set(title=title, ylabel=label, xlabel=words.steps if curve else "wall time (s)")
        axis.grid(alpha=0.3)
        if not points:
            axis.text(0.5, 0.5, "not reported", transform=axis.transAxes, ha="center", va="center")
    draw_evaluations(axes.flat[0], run_dir / "metrics.jsonl")  # `eval`'s rows, and atropos.eval_every_steps'
    last = rows[-1]
    figure.suptitle(
        f"{run_dir.name}: {last['env_steps']:,} {words.steps} in {last['wall_time_s']:.0f} s, "
        f"policy version {last.get('policy_version')}"
    )
    path = out or run_dir / "report.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
