"""What ``up`` and ``report`` say of a run, in its own words: a control run's env steps, episodes and return, a
language model's tokens, answers and reward (and no policy lag, which its trainer does not measure); steps/s over
the latest reports rather than the last one alone, an ETA at that rate; the summary's overall throughput and the
Tinker clients' checkpoints; ``report``'s curve over the window the run's config sets."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from rich.console import Console
from typer.testing import CliRunner

from tinker_atropos.config import Config, parse_config
from tinker_atropos.launcher.cli import app
from tinker_atropos.launcher.progress import CONTROL, LANGUAGE_MODEL, ProgressReporter, RunWords
from tinker_atropos.launcher.report import draw_report, panels, run_settings
from tinker_atropos.launcher.run_figures import StepRate
from tinker_atropos.launcher.up import _summary

LANGUAGE_CONFIG = {
    "run": {"name": "answers", "return_window": 64},
    "env": {"services": 0},
    "rollout": {"replicas": 0},
    "trainer": {"experience_loop": False, "atropos": {"enabled": True}},
}


def test_steps_per_second_are_over_the_latest_reports_and_steady_when_steps_come_in_batches() -> None:
    """A batch of 10,000 tokens every 6 s, a report every 2 s: per report the rate swung 0, 0, 5,000; over the
    latest 30 s it stays within 20% of 1,667 once the window is full."""
    rate = StepRate(now=0.0, steps=0)
    rates = [rate.rate(float(t), 10_000 * (t // 6)) for t in range(2, 121, 2)]
    assert all(1_667 * 0.8 < r < 1_667 * 1.2 for r in rates[15:]), rates
    assert rates[:3] == [0.0, 0.0, 10_000 / 6]  # early on, since the first row


def _reporter(words: RunWords, tmp_path: Path) -> ProgressReporter:
    """A reporter that never reaches a Redis: only its lines are asked for."""
    return ProgressReporter("redis://127.0.0.1:1", "run", tmp_path / "metrics.jsonl", Console(), words=words)


def _row(steps: int, rate: float) -> dict:
    return {
        "env_steps": steps,
        "env_steps_per_s": rate,
        "episodes": 320,
        "episode_return_mean": 0.64,
        "policy_version": 10,
        "trainer_busy": 0.8,
        "policy_lag_mean": 0.0,
        "counters": {},
    }


def test_the_console_line_speaks_of_tokens_answers_and_reward_on_a_language_model_run(tmp_path: Path) -> None:
    language, control = _reporter(LANGUAGE_MODEL, tmp_path), _reporter(CONTROL, tmp_path)
    line = language.line(_row(12_345, 400.0))
    assert "12,345[/] tokens" in line and "400 tokens/s" in line and "answers    320" in line, line
    assert "reward    0.640" in line and "lag" not in line and "steps" not in line, line
    line = control.line(_row(12_345, 400.0))
    assert "12,345[/] steps" in line and "400 steps/s" in line and "episodes    320" in line, line
    assert "return    0.640" in line and "lag 0.0" in line, line


def test_the_eta_is_at_the_latest_rate_not_the_rate_since_start_up(tmp_path: Path) -> None:
    reporter = _reporter(LANGUAGE_MODEL, tmp_path)
    reporter.total_steps = 10_000
    reporter.figures.start -= 600  # ten minutes of start-up and learning: not what is left to do
    assert reporter.line(_row(5_000, 100.0)).endswith("50% ETA 0m50s")
    assert reporter.line(_row(5_000, 0.0)).endswith("50% ETA ?")  # no steps of late: no guess


def _summarized(config: Config, run_dir: Path, row: dict, seconds: float = 300.0) -> str:
    console = Console(record=True, width=400)
    words = RunWords.of(config.trainer.atropos.enabled)
    reporter: Any = SimpleNamespace(last_row=row, words=words, incidents=dict)  # what the summary reads of it
    _summary(console, config, run_dir, "600 s of wall time spent", seconds, reporter, None, [])
    return console.export_text()


def test_the_summary_gives_the_overall_throughput_in_the_runs_words(tmp_path: Path) -> None:
    summary = _summarized(parse_config(LANGUAGE_CONFIG), tmp_path, _row(12_300, 400.0))
    assert (
        ": 12,300 tokens (12,300 in this session), policy version 10, mean reward 0.640 (last 64 answers)"
        in (summary)
    ), summary
    assert "  throughput   41.0 tokens/s over this session\n" in summary, summary
    control = _summarized(parse_config({}), tmp_path, _row(30_000, 400.0), seconds=10.0)
    assert "30,000 env steps (30,000 in this session)" in control and "(last 10 episodes)" in control, control
    assert "  throughput   3,000.0 env steps/s over this session\n" in control, control


def test_a_tinker_only_runs_summary_counts_the_checkpoints_its_clients_saved(tmp_path: Path) -> None:
    config = parse_config(
        {"env": {"id": "Pendulum-v1"}, "trainer": {"experience_loop": False, "tinker": {"enabled": True}}}
    )
    model = tmp_path / "tinker" / "s_train_0"
    for name in ("weights/first.pt", "sampler_weights/ephemeral-3.pt", "state-4.pt", "weights/final.pt"):
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(b"")
    os.utime(model / "weights/first.pt", (1, 1))  # older than final.pt
    summary = _summarized(config, tmp_path, _row(0, 0.0))
    assert f"  checkpoints  {tmp_path / 'tinker'}/ (2 saved, latest: s_train_0/weights/final.pt)" in summary
    with_loop = parse_config(
        {"trainer": {"tinker": {"enabled": True, "checkpoint_dir": str(tmp_path / "none")}}}
    )
    summary = _summarized(with_loop, tmp_path, _row(0, 0.0))
    assert "checkpoints  " in summary and f"  tinker       {tmp_path / 'none'}/ (none saved)" in summary, (
        summary
    )


def test_the_reports_curve_is_over_the_configured_window_in_the_runs_words(tmp_path: Path) -> None:
    assert run_settings(tmp_path) == (CONTROL, 10)  # no config.yaml: a control run's, the default window
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"return_window": 20}}))
    assert panels(*run_settings(tmp_path))[0][2] == "mean return of the last 20 episodes"
    (tmp_path / "config.yaml").write_text(parse_config(LANGUAGE_CONFIG).to_yaml())
    curve, throughput, apart, _ = panels(*run_settings(tmp_path))
    assert (curve[2], throughput[2]) == ("mean reward of the last 64 answers", "tokens/s")
    assert apart[0] == "losses/kl_sampler_learner"  # in place of a policy lag the loop does not measure
    rows = [
        _row(100 * i, 10.0) | {"wall_time_s": i, "losses": {"kl_sampler_learner": 0.01}} for i in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert draw_report(tmp_path).exists()


def test_up_help_names_the_configured_window_for_target_return() -> None:
    shown = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"})
    assert "run.return_window" in shown.output and "last 10 episodes" not in shown.output, shown.output
