"""Weights & Biases by config only: off, the trainer never imports wandb (so it makes no network call); on, in
offline mode, the trainer's TensorBoard events are mirrored into a W&B run under RUN_DIR/wandb, named after the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tinker_atropos.config import ConfigError, WandbSection, parse_config
from tinker_atropos.trainer.tensorboard import TensorBoardLog


def test_off_wandb_is_never_imported(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from tinker_atropos.config import parse_config; "
        "from tinker_atropos.trainer.tensorboard import TensorBoardLog; "
        f"log = TensorBoardLog(Path({str(tmp_path / 'tb')!r}), None, 'run', parse_config({{}}).trainer.wandb); "
        "log.writer.add_scalar('charts/SPS', 1.0, 1); log.close(); print('wandb' in sys.modules)"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.strip() == "False", shown.stderr[-2000:]


def test_on_the_events_are_mirrored_to_an_offline_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    section = WandbSection(enabled=True, mode="offline", project="tests")
    log = TensorBoardLog(
        run_dir / "tensorboard", None, "mirrored-run", section, {"trainer": {"algorithm": "sac"}}
    )
    for step in range(5):
        log.writer.add_scalar("charts/episodic_return", -100.0 * step, step)
    log.close()
    [record] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = record.read_bytes()
    assert b"charts/episodic_return" in data and b"mirrored-run" in data


def test_wandb_without_tensorboard_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="trainer.wandb.enabled needs trainer.tensorboard"):
        parse_config({"trainer": {"tensorboard": False, "wandb": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"trainer.wandb.mode"):
        parse_config({"trainer": {"wandb": {"mode": "cloudy"}}})
