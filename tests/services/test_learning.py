"""End to end: `tinker-atropos up` runs Valkey and the three services as OS processes, and PPO learns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.support.asserts import assert_moving_video
from tests.support.running import REPO, assert_learned, cli, leftovers, report_rows

pytestmark = pytest.mark.integration


def run_up(
    config: str, run_dir: Path, total_steps: int, target_return: float, **trainer: object
) -> list[dict]:
    """``up`` on ``configs/CONFIG`` (``trainer`` entries set), reporting every 0.5 s: the first row with episodes
    comes before learning took off, also on a fast machine."""
    resolved = yaml.safe_load((REPO / "configs" / config).read_text())
    resolved.setdefault("run", {})["report_interval_s"] = 0.5
    resolved.setdefault("trainer", {}).update(trainer)
    path = run_dir.parent / f"reporting-{config}"
    path.write_text(yaml.safe_dump(resolved))
    result = cli(
        "up",
        str(path),
        "--run-dir",
        str(run_dir),
        "--total-steps",
        str(total_steps),
        "--target-return",
        str(target_return),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert leftovers(run_dir) == "", "processes left behind"
    return report_rows(run_dir)


def test_pendulum_learns_to_swing_up(tmp_path: Path) -> None:
    budget = 200_000
    rows = run_up("pendulum.yaml", tmp_path / "run", budget, target_return=-400.0)
    assert_learned(rows, random_below=-900.0, target=-400.0, budget=budget)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    # the shipped config anneals the learning rate over 1M env steps and stops an update past a KL of 0.05
    updates = [row["losses"] for row in rows if row["losses"]]
    rates = [losses["learning_rate"] for losses in updates]
    assert rates[0] <= 1e-3 and rates == sorted(rates, reverse=True) and rates[-1] < rates[0], rates
    assert all(0 < losses["epochs"] <= 10 for losses in updates)


def test_pendulum_learns_with_sac_from_its_replay_buffer(tmp_path: Path) -> None:
    """SAC: chunks go into the trainer's replay buffer, one gradient step per env step; none is ever stale."""
    budget = 30_000
    evaluation = {"every_updates": 25, "episodes": 4, "instances": 2}  # on an env service of its own
    rows = run_up("pendulum-sac.yaml", tmp_path / "run", budget, target_return=-300.0, evaluation=evaluation)
    assert_learned(rows, random_below=-900.0, target=-300.0, budget=budget)
    assert rows[-1]["counters"].get("chunks_rejected_stale", 0) == 0
    # the update-to-data ratio held: one gradient step per env step received since learning started
    learning = [row["losses"] for row in rows if row["losses"].get("gradient_steps", 0) > 0]
    assert learning and all(row["utd_ratio"] == pytest.approx(1.0, abs=0.01) for row in learning)
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    # periodic evaluations, of versions the trainer published, their figures in the report rows
    evaluated_versions = [
        int(v) for v in re.findall(r"evaluation of policy version (\d+): mean return", trainer_log)
    ]
    assert len(evaluated_versions) >= 2 and evaluated_versions == sorted(evaluated_versions), trainer_log[
        -2000:
    ]
    assert any(row["eval_return_mean"] is not None for row in rows)
    # the best evaluation's policy is kept beside the latest checkpoints (best.pt), and eval --best plays it
    returns = [
        float(r) for r in re.findall(r"evaluation of policy version \d+: mean return (-?[\d.]+)", trainer_log)
    ]
    kept = re.findall(r"best\.pt: policy version (\d+), the best evaluation so far", trainer_log)
    best_return = float(
        re.search(rf"evaluation of policy version {kept[-1]}: mean return (-?[\d.]+)", trainer_log)[1]
    )
    assert best_return >= max(returns) - 0.05, (kept, returns)
    played = cli("eval", str(tmp_path / "run"), "--best", "--episodes", "2", "--json")
    assert played.returncode == 0, played.stderr[-3000:]
    assert json.loads(played.stdout)["policy_version"] == int(kept[-1])
    assert json.loads(played.stdout)["checkpoint"].endswith("checkpoints/best.pt")
    # the stopped run's policy, acting with tanh of its mean, plays whole episodes in `eval`, and a video (pygame)
    video = tmp_path / "pendulum.mp4"
    evaluated = cli(
        "eval",
        str(tmp_path / "run"),
        "--episodes",
        "6",
        "--json",
        "--video",
        str(video),
        "--video-frames",
        "40",
    )  # config.yaml: written by up
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout)
    assert result["video_frames"] == 40
    assert_moving_video(video, 40)
    assert result["episodes"] == 6 and result["deterministic"] and result["length_mean"] == 200
    assert result["policy_version"] == rows[-1]["policy_version"]
    # random play: about -1,200; a policy just past the target may still miss one swing-up in 6 starts (-1,532
    # beside five near -380 in one run: a mean of -569)
    assert result["return_mean"] > -700.0, result
    assert_tensorboard_and_report(tmp_path / "run", rows)


def assert_tensorboard_and_report(run_dir: Path, rows: list[dict]) -> None:
    """The trainer's TensorBoard events hold every episode and the CleanRL tags; `report` draws the PNG."""
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "charts/episodic_return",
        "charts/episodic_length",
        "charts/SPS",
        "charts/policy_version",
        "charts/trainer_busy",
    } <= tags and any(tag.startswith("losses/") for tag in tags), tags
    returns = [event.value for event in events.Scalars("charts/episodic_return")]
    lengths = {event.value for event in events.Scalars("charts/episodic_length")}
    steps = [event.step for event in events.Scalars("charts/episodic_return")]
    assert len(returns) >= 0.8 * rows[-1]["episodes"] and lengths == {200.0}  # written once each, none lost
    assert steps == sorted(steps) and 0 < steps[-1] <= rows[-1]["env_steps"]
    early, late = sum(returns[:5]) / 5, sum(returns[-10:]) / 10  # written as they came: the curve rises
    assert early < -900 and late > early + 300, returns
    assert all(event.value > 0 for event in events.Scalars("charts/SPS"))
    assert len(events.Scalars("eval/episodic_return")) >= 1
    drawn = cli("report", str(run_dir))
    assert drawn.returncode == 0 and drawn.stdout.strip() == str(run_dir / "report.png"), drawn.stderr
    assert imread(run_dir / "report.png").shape[:2] == (800, 1200)


def test_eval_and_report_without_their_inputs_say_so_in_one_line(tmp_path: Path) -> None:
    empty, config = tmp_path / "empty", str(REPO / "configs" / "pendulum.yaml")
    no_folder = cli("eval", str(empty), "--config", config)  # a typo in the folder: said so, config or not
    assert (no_folder.returncode, no_folder.stderr.strip()) == (
        2,
        f"error: run folder {empty} does not exist (`up` makes runs/RUN_NAME)",
    )
    empty.mkdir()
    no_config = cli("eval", str(empty))
    assert (no_config.returncode, no_config.stderr.strip()) == (
        2,
        f"error: {empty / 'config.yaml'} does not exist: pass the run's config with --config",
    )
    no_checkpoint = cli("eval", str(empty), "--config", config)
    assert (no_checkpoint.returncode, no_checkpoint.stderr.strip()) == (
        2,
        f"error: no readable checkpoint in {empty / 'checkpoints'}: train first (`tinker-atropos up`)",
    )
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    no_report = cli("report", str(empty))
    assert (no_report.returncode, no_report.stderr.strip()) == (
        2,
        f"error: no report rows in {empty / 'metrics.jsonl'}: `tinker-atropos up` writes them",
    )
    mangled = tmp_path / "mangled"
    mangled.mkdir()
    (mangled / "metrics.jsonl").write_text(
        '{"env_steps": 10\nnot json\n{"env_steps": "x"}\n{"env_steps": 5}\n'
        '{"env_steps": 64, "wall_time_s": 2.0, "episode_return_mean": -900}\n'
    )
    # the rows that are not report rows are skipped, the one that is drawn
    drawn = cli("report", str(mangled))
    assert drawn.returncode == 0 and (mangled / "report.png").exists(), drawn.stderr[-2000:]
    garbage = cli("eval", str(empty), "--config", config, "--checkpoint", str(tmp_path / "garbage.pt"))
    assert garbage.returncode == 2
    assert garbage.stderr.startswith(f"error: checkpoint {tmp_path / 'garbage.pt'} does not load: ")
    assert len(garbage.stderr.strip().splitlines()) == 1


def test_cartpole_learns_to_balance(tmp_path: Path) -> None:
    budget = 200_000
    rows = run_up("cartpole.yaml", tmp_path / "run", budget, target_return=300.0)
    assert_learned(rows, random_below=100.0, target=300.0, budget=budget)


def test_cartpole_learns_with_appo_from_lagging_chunks(tmp_path: Path) -> None:
    """APPO: the rollouts never pause, chunks of older policies are corrected by V-trace, and it learns."""
    budget = 300_000
    rows = run_up("cartpole-appo.yaml", tmp_path / "run", budget, target_return=300.0)
    # half the target, not random play's 22: the rollouts never pause, and on a loaded 2-core machine the first
    # report row has come after the first updates, at 101 and 138 (CI); a trained policy starts near 500
    assert_learned(rows, random_below=150.0, target=300.0, budget=budget)
    # it learned from older policies' chunks, within trainer.max_policy_lag (older ones are dropped): the run's
    # counters, flushed by the trainer as it stops, count the accepted chunks by lag
    by_lag = {
        int(name.removeprefix("chunks_lag_")): n
        for name, n in rows[-1]["counters"].items()
        if name.startswith("chunks_lag_")
    }
    assert sum(n for lag, n in by_lag.items() if lag >= 1) > 0, by_lag
    assert max(by_lag) <= 4, by_lag
    assert sum(by_lag.values()) <= rows[-1]["counters"]["chunks_written"]
    # the trainer's own view, its latest 200 chunks, says the same while it runs
    assert all(0 <= int(lag) <= 4 for row in rows for lag in row["policy_lag_counts"])
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    # greedy acting (the most likely action) with the stopped run's policy, in `eval`
    evaluated = cli("eval", str(tmp_path / "run"), "--episodes", "4", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout)
    assert result["episodes"] == 4 and result["deterministic"]
    assert result["return_mean"] > 150.0, result  # random play: about 22
