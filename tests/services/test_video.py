"""``tinker-atropos eval --video``: a briefly trained Hopper (MuJoCo, rendered through EGL without a display) played
by the run's policy, written as an MP4 whose frames move and a GIF beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.asserts import assert_moving_video
from tests.support.running import cli, config_file, leftovers

pytestmark = pytest.mark.integration


def test_eval_renders_a_hopper_run_through_egl_to_an_mp4_and_a_gif(tmp_path: Path) -> None:
    """(Pendulum, drawn by pygame, is rendered from the SAC run of tests/services/test_learning.py.)"""
    env_id, frames = "Hopper-v5", 60
    run_dir = tmp_path / "run"
    config = config_file(
        tmp_path,
        run={"name": f"video-{env_id}"},
        env={"id": env_id, "instances": 4},
        trainer={"samples_per_update": 512},
        rollout={"chunk_length": 32},
    )
    trained = cli("up", str(config), "--run-dir", str(run_dir), "--total-steps", "2048", timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert leftovers(run_dir) == ""
    out = tmp_path / "videos" / "policy.mp4"
    shown = cli(
        "eval",
        str(run_dir),
        "--episodes",
        "2",
        "--video",
        str(out),
        "--video-frames",
        str(frames),
        "--json",
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    result = json.loads(shown.stdout)  # stdout is only the JSON: no renderer's greeting on it
    assert result["video"] == str(out) and result["gif"] == str(out.with_suffix(".gif"))
    # one episode, cut at the frame limit or ended before (a barely trained Hopper falls within 40 steps)
    assert 10 <= result["video_frames"] <= frames and len(result["video_returns"]) == 1
    assert_moving_video(out, result["video_frames"])
