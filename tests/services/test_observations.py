"""Dict and image observations: the env contract carries the Dict (its entries travel flattened, in key order),
the policy splits them back, one encoder per key (a CNN for an image), and a run learns from them end to end."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from tests.support.reach_env import SIDE, Reach
from tests.support.running import assert_learned, cli, leftovers, report_rows
from tinker_atropos.config import parse_config
from tinker_atropos.environment.backends.base import BatchSetup
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.environment.check import check_env
from tinker_atropos.environment.spaces import space_from_proto, space_to_proto
from tinker_atropos.errors import EnvError
from tinker_atropos.models.acting import InferencePolicy
from tinker_atropos.models.encoders import ObservationEncoder
from tinker_atropos.models.mlp import ActorCritic, mlp_spec

ENV = "tests.support.reach_env:Reach"
FLAT = 2 + 2 + SIDE * SIDE


def test_a_dict_space_crosses_the_wire_in_its_own_order() -> None:
    space = gym.spaces.Dict(
        [("zeta", gym.spaces.Box(0, 1, (2,))), ("alpha", gym.spaces.Box(0, 255, (4, 4, 3), np.uint8))]
    )
    back = space_from_proto(space_to_proto(space))
    assert list(back.spaces) == ["zeta", "alpha"]  # the flat order, not sorted
    assert back.spaces["alpha"].shape == (4, 4, 3) and back.spaces["alpha"].dtype == np.uint8


def test_the_backend_flattens_dict_observations_in_key_order_and_keeps_the_layout() -> None:
    batch = GymnasiumBatch(BatchSetup(ENV, {}, 3))
    reference = Reach()
    try:
        assert batch.observation_space.shape == (FLAT,) and batch.observation_space.dtype == np.float32
        assert list(batch.observation_layout.spaces) == ["goal", "position", "view"]
        observations = batch.reset(seed=7)
        first, _ = reference.reset(seed=7)
        np.testing.assert_array_equal(observations[0, :2], first["goal"])
        np.testing.assert_array_equal(observations[0, 2:4], first["position"])
        np.testing.assert_array_equal(observations[0, 4:].reshape(SIDE, SIDE, 1), first["view"])
        for _ in range(reference.max_steps):  # to the time limit: the final observations are flat too
            step = batch.step(np.zeros((3, 2), np.float32))
        assert step.truncated.all() and step.final_observations.shape == (3, FLAT)
    finally:
        batch.close()
    spaces = check_env(parse_config({"env": {"id": ENV, "instances": 1}}).env)
    assert spaces.observation_layout is not None and spaces.observation_space.shape == (FLAT,)


def test_a_dict_of_other_spaces_is_refused_in_one_line() -> None:
    from tinker_atropos.environment.envs import observation_layout

    with pytest.raises(EnvError, match=r"a Dict's entries must be Box spaces \(not 'mode'\)"):
        observation_layout(gym.spaces.Dict({"mode": gym.spaces.Discrete(3), "x": gym.spaces.Box(0, 1, (2,))}))


def test_each_entry_reaches_its_own_encoder() -> None:
    encoder = ObservationEncoder([("goal", [2]), ("view", [SIDE, SIDE, 1]), ("position", [2])])
    observations = torch.randn(5, FLAT)
    features = encoder(observations)
    image = observations[:, 2 : 2 + SIDE * SIDE].reshape(5, SIDE, SIDE, 1).permute(0, 3, 1, 2)
    expected = torch.cat([observations[:, :2], encoder.cnns["1"](image), observations[:, -2:]], dim=1)
    torch.testing.assert_close(features, expected)
    assert encoder.out_dim == 2 + 256 + 2 and encoder.in_dim == FLAT


@pytest.mark.parametrize("kind", ["dict", "image"])
def test_the_rollout_acts_with_the_encoded_policy_as_the_trainer_evaluates_it(kind: str) -> None:
    model_section = parse_config({}).trainer.model
    if kind == "dict":
        layout = Reach().observation_space
        spec = mlp_spec(
            gym.spaces.Box(-1, 1, (FLAT,)),
            gym.spaces.Box(-1, 1, (2,)),
            model_section,
            True,
            True,
            observation_layout=layout,
        )
        observations = np.random.default_rng(0).normal(size=(6, FLAT)).astype(np.float32)
    else:  # a Box of H x W x C gets a CNN without being a Dict
        spec = mlp_spec(gym.spaces.Box(0, 1, (40, 40, 3)), gym.spaces.Discrete(4), model_section, True, True)
        observations = np.random.default_rng(0).random((6, 40, 40, 3)).astype(np.float32)
    model = ActorCritic(spec)
    assert model.encoded
    policy = InferencePolicy.of_model(model, "cpu", np.random.default_rng(1))
    actions, log_probs, values = policy.act(observations)
    with torch.no_grad():
        normalised = model.normalize_obs(torch.as_tensor(observations))
        expected_log_probs = model.log_prob(model.distribution(normalised), torch.as_tensor(actions))
        expected_values = model.denormalize_value(model.normalized_value(normalised))
    np.testing.assert_allclose(log_probs, expected_log_probs.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(values, expected_values.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.integration
def test_a_dict_observation_env_learns_end_to_end(tmp_path: Path) -> None:
    """Reach, served by the env service, its Dict observations flattened on the wire, a CNN on the view: PPO
    moves the point towards the goal (a random walk stays about 0.8 away: a return near -32 over 40 steps)."""
    config = {
        "run": {"name": "reach", "report_interval_s": 0.5},
        "env": {"id": ENV, "instances": 8},
        "rollout": {"chunk_length": 40},
        "trainer": {
            "samples_per_update": 640,
            "max_policy_lag": 1,
            "ppo": {"learning_rate": 1e-3, "num_minibatches": 4, "update_epochs": 4, "gamma": 0.9},
        },
    }
    path = tmp_path / "reach.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli(
        "up",
        str(path),
        "--run-dir",
        str(tmp_path / "run"),
        "--total-steps",
        "60000",
        "--target-return",
        "-12",
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert leftovers(tmp_path / "run") == ""
    assert_learned(report_rows(tmp_path / "run"), random_below=-20.0, target=-12.0, budget=60_000)
    for log in (tmp_path / "run" / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
