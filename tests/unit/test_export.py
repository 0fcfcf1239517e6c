"""`tinker-atropos export`: the exported policy acts as the rollouts' acting form does in evaluation (the mode),
the observation normaliser folded in, in ONNX Runtime and as a torch.export program, for any batch size."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from tests.support.running import REPO, cli, cli_here
from tinker_atropos.models.acting import InferencePolicy
from tinker_atropos.models.export import export_policy
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.models.weight_bytes import weights_to_bytes
from tinker_atropos.state.checkpoint_files import save_checkpoint

ACTIONS = {
    "gaussian": {"kind": "box", "shape": [2]},
    "squashed": {"kind": "box", "shape": [2], "squash": True, "low": [-2.0, -0.5], "high": [2.0, 1.5]},
    "discrete": {"kind": "discrete", "n": 3, "start": 5},
}


def trained_looking(kind: str, obs_dim: int = 3) -> ActorCritic:
    """A policy away from its initialisation, with non-trivial observation statistics, as after training."""
    torch.manual_seed(0)
    spec = {
        "obs_shape": [obs_dim],
        "action": ACTIONS[kind],
        "hidden_sizes": [16, 16],
        "activation": "tanh",
        "init_log_std": -0.5,
        "normalize_observations": True,
        "normalize_returns": True,
    }
    model = ActorCritic(spec)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    model.obs_rms.update(torch.randn(256, obs_dim) * 3 + 1)
    return model


@pytest.mark.parametrize("kind", list(ACTIONS))
def test_exported_policies_act_as_the_rollouts_mode(tmp_path: Path, kind: str) -> None:
    model = trained_looking(kind)
    acting = InferencePolicy.of_model(model, "cpu")
    onnx_session = onnxruntime.InferenceSession(str(*export_policy(model, tmp_path / "p.onnx", "onnx")))
    exported = torch.export.load(str(*export_policy(model, tmp_path / "p.pt2", "pt2"))).module()
    for batch in (1, 7):  # the batch size is free in both formats
        obs = np.random.default_rng(batch).normal(1.0, 4.0, size=(batch, 3)).astype(np.float32)
        expected = acting.act(obs, deterministic=True)[0]
        from_onnx = onnx_session.run(["actions"], {"observations": obs})[0]
        with torch.no_grad():
            from_torch = exported(torch.as_tensor(obs)).numpy()
        if kind == "discrete":
            assert from_onnx.tolist() == from_torch.tolist() == expected.tolist()
            assert set(expected.tolist()) <= {5, 6, 7}
        else:
            np.testing.assert_allclose(from_onnx, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(from_torch, expected, rtol=1e-5, atol=1e-5)
    if kind == "squashed":  # within the bounds, whatever the observation
        extreme = acting.act(np.full((1, 3), 1e4, np.float32), deterministic=True)[0]
        assert np.all(extreme >= [-2.0, -0.5]) and np.all(extreme <= [2.0, 1.5])


def test_export_from_a_run_folder_and_its_errors(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((REPO / "configs" / "pendulum.yaml").read_text())
    model = trained_looking("gaussian")
    record = {"spec": model.spec, "version": 12, "weights": weights_to_bytes(model)}
    save_checkpoint(run_dir / "checkpoints", 12, {"policy": record}, keep=2)

    (run_dir / "policy.onnx.data").write_text("an older export's weights")
    made = cli("export", str(run_dir), "--format", "onnx")
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.startswith(f"{run_dir / 'policy.onnx'}: policy version 12 of ")
    assert made.stderr == ""  # nothing of torch's exporters: no mode warning, no torchvision, no deprecation
    # one self-contained file: copied alone, it loads and acts
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("policy")) == ["policy.onnx"]
    copied = tmp_path / "robot" / "controller.onnx"
    copied.parent.mkdir()
    shutil.copy(run_dir / "policy.onnx", copied)
    obs = np.zeros((4, 3), np.float32)
    actions = onnxruntime.InferenceSession(str(copied)).run(None, {"observations": obs})[0]
    np.testing.assert_allclose(
        actions, InferencePolicy.of_model(model, "cpu").act(obs, deterministic=True)[0], atol=1e-5
    )

    elsewhere = cli(
        "export", str(run_dir), "--format", "pt2", "--out", str(tmp_path / "new" / "folder" / "p.pt2")
    )
    assert elsewhere.returncode == 0 and elsewhere.stderr == "", elsewhere.stderr[-3000:]
    assert (tmp_path / "new" / "folder" / "p.pt2").stat().st_size > 0  # the folder made, as SB3's save does
    unwritable = cli_here("export", str(run_dir), "--out", str(run_dir / "config.yaml" / "p.onnx"))
    assert (unwritable.returncode, unwritable.stderr.strip()) == (
        1,
        f"error: cannot write {run_dir / 'config.yaml' / 'p.onnx'}: a file stands where its folder would be",
    )
    wrong = cli_here("export", str(run_dir), "--format", "tflite")
    assert (wrong.returncode, wrong.stderr.strip()) == (
        2,
        "error: --format 'tflite' is not one of: onnx, pt2, peft, merged",
    )
    missing = cli_here(
        "export",
        str(run_dir),
        "--config",
        str(REPO / "configs" / "pendulum.yaml"),
        "--checkpoint",
        str(tmp_path / "missing.pt"),
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"error: checkpoint {tmp_path / 'missing.pt'} does not load: ")
    for command in ("export", "eval"):  # a run folder that is not there is named as such
        nowhere = cli_here(command, str(tmp_path / "no-such-run"))
        assert (nowhere.returncode, nowhere.stderr.strip()) == (
            2,
            f"error: run folder {tmp_path / 'no-such-run'} does not exist (`up` makes runs/RUN_NAME)",
        )


def test_a_missing_export_extra_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without onnxscript (a plain install), torch's exporter fails 60 lines deep on its import: the command says
    which extra to install instead, in one line, and writes nothing."""
    from typer.testing import CliRunner

    from tinker_atropos.launcher.cli import app

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((REPO / "configs" / "pendulum.yaml").read_text())
    model = trained_looking("gaussian")
    record = {"spec": model.spec, "version": 1, "weights": weights_to_bytes(model)}
    save_checkpoint(run_dir / "checkpoints", 1, {"policy": record}, keep=2)
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # what importlib finds of a package not installed
    result = CliRunner().invoke(app, ["export", str(run_dir), "--format", "onnx"])
    assert (result.exit_code, result.output.strip()) == (
        2,
        "error: the ONNX exporter needs onnxscript: pip install 'tinker-atropos[export]'",
    )
    assert not (run_dir / "policy.onnx").exists()
