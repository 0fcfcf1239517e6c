"""Acting from published weights with numpy alone: what a rollout does on a CPU with the built-in MLP."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinker_atropos.models.acting import InferencePolicy, load_policy
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.models.spec import mlp_state_shapes
from tinker_atropos.models.weight_bytes import weights_to_bytes

BASE = {
    "obs_shape": [3],
    "hidden_sizes": [8, 6],
    "activation": "tanh",
    "init_log_std": -0.5,
    "normalize_observations": True,
    "normalize_returns": True,
}
SPECS = {
    "gaussian": {**BASE, "action": {"kind": "box", "shape": [2]}},
    "squashed": {
        **BASE,
        "action": {"kind": "box", "shape": [2], "squash": True, "low": [-2, -1], "high": [2, 3]},
        "critic": False,
    },
    "discrete": {**BASE, "action": {"kind": "discrete", "n": 3, "start": 5}, "obs_shape": [2, 2]},
}


def trained(spec: dict) -> ActorCritic:
    """A network with non-trivial normalisers, as after training."""
    torch.manual_seed(0)
    model = ActorCritic(spec)
    model.obs_rms.update(torch.randn(64, *spec["obs_shape"]).flatten(1) * 5 + 2)
    model.return_rms.update(torch.randn(64) * 30 - 10)
    return model


@pytest.mark.parametrize("kind", SPECS)
def test_the_spec_names_every_tensor_of_the_network_with_its_shape(kind: str) -> None:
    model = ActorCritic(SPECS[kind])
    assert mlp_state_shapes(SPECS[kind]) == {name: tuple(t.shape) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("kind", SPECS)
def test_published_weights_act_as_the_network_in_memory(kind: str) -> None:
    spec, model = SPECS[kind], trained(SPECS[kind])
    obs = np.random.default_rng(0).normal(size=(5, *spec["obs_shape"])).astype(np.float32) * 4
    loaded = load_policy(spec, weights_to_bytes(model), "cpu", np.random.default_rng(1))
    in_memory = InferencePolicy.of_model(model, "cpu", np.random.default_rng(1))
    for got, expected in zip(loaded.act(obs), in_memory.act(obs), strict=True):
        np.testing.assert_array_equal(got, expected)
    legacy = io.BytesIO()  # torch's own format, as versions before the npz published: still read
    torch.save(model.state_dict(), legacy)
    np.testing.assert_array_equal(
        load_policy(spec, legacy.getvalue()).act(obs, deterministic=True)[0],
        in_memory.act(obs, deterministic=True)[0],
    )


def test_weights_that_do_not_fit_the_spec_are_refused_naming_the_tensor() -> None:
    spec = SPECS["gaussian"]
    wider = weights_to_bytes(ActorCritic({**spec, "hidden_sizes": [8, 7]}))
    with pytest.raises(ValueError, match=r"actor\.2\.weight is \(7, 8\), expected \(6, 8\)"):
        load_policy(spec, wider)
    without_critic = weights_to_bytes(ActorCritic({**spec, "critic": False}))
    with pytest.raises(ValueError, match=r"critic\.0\.bias is missing, expected \(8,\)"):
        load_policy(spec, without_critic)
    with pytest.raises(ValueError, match="a spec that describes no MLP: KeyError: 'hidden_sizes'"):
        load_policy({k: v for k, v in spec.items() if k != "hidden_sizes"}, wider)
    with pytest.raises(ValueError, match="a spec this rollout cannot act with: KeyError: 'swish'"):
        load_policy({**spec, "activation": "swish"}, weights_to_bytes(ActorCritic(spec)))


ACT_WITHOUT_TORCH = """
import json, sys
import numpy as np
from tinker_atropos.rollout import service
from tinker_atropos.models.acting import load_policy
spec = json.loads(open(sys.argv[1]).read())
policy = load_policy(spec, open(sys.argv[2], "rb").read())
actions, _, values = policy.act(np.zeros((4, 3), np.float32))
print(json.dumps({"torch": "torch" in sys.modules, "actions": actions.shape, "values": values.shape}))
"""


def test_a_rollout_process_acts_with_the_mlp_without_importing_torch(tmp_path: Path) -> None:
    """torch costs a rollout process 2 s of CPU at start and 180 MB: the built-in MLP on a CPU needs neither."""
    spec = SPECS["gaussian"]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "weights").write_bytes(weights_to_bytes(trained(spec)))
    acted = subprocess.run(
        [sys.executable, "-c", ACT_WITHOUT_TORCH, str(tmp_path / "spec.json"), str(tmp_path / "weights")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert acted.returncode == 0, acted.stderr[-2000:]
    assert json.loads(acted.stdout) == {"torch": False, "actions": [4, 2], "values": [4]}
