"""A user network by import path (``trainer.model.network: module:Class``): trained by the algorithms, acted with
by the rollouts from the published spec, and refused in one line when it cannot serve."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from tests.support.running import REPO, cli
from tests.support.user_networks import LayerNormActorCritic
from tinker_atropos.algorithms.base import LearnerSetup, algorithm
from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.models.acting import load_policy
from tinker_atropos.models.networks import build_network
from tinker_atropos.protocol.trajectory import Trajectory

USER = "tests.support.user_networks:LayerNormActorCritic"
OBS_SPACE = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
BOX = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)


def learner(name: str, network: str):
    section = {"learning_starts": 50, "batch_size": 32} if name == "sac" else {}
    config = parse_config({"trainer": {"algorithm": name, "model": {"network": network}, name: section}})
    setup = LearnerSetup(
        OBS_SPACE, BOX, config.trainer, config.trainer.hyperparameters, torch.device("cpu"), 0
    )
    return algorithm(name).build(setup)


def trajectory(rng: np.random.Generator, values: bool, t: int = 16, n: int = 4) -> Trajectory:
    critic = (
        {
            "values": np.zeros((t, n), np.float32),
            "truncation_values": np.zeros((t, n), np.float32),
            "bootstrap_values": np.zeros(n, np.float32),
        }
        if values
        else {}
    )
    return Trajectory(
        policy_version=0,
        observations=rng.normal(size=(t, n, 3)).astype(np.float32),
        actions=rng.uniform(-2, 2, (t, n, 1)).astype(np.float32),
        log_probs=np.full((t, n), -1.0, np.float32),
        rewards=rng.normal(size=(t, n)).astype(np.float32),
        terminated=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool),
        bootstrap_observations=rng.normal(size=(n, 3)).astype(np.float32),
        truncated_observations=np.zeros((0, 3), np.float32),
        **critic,
    )


@pytest.mark.parametrize("name", ["ppo", "sac"])
def test_a_user_network_learns_and_the_rollout_acts_with_its_published_weights(name: str) -> None:
    trained = learner(name, USER)
    assert type(trained.core.model) is LayerNormActorCritic
    before = {k: v.clone() for k, v in trained.core.model.state_dict().items()}
    rng = np.random.default_rng(0)
    trained.learn([trajectory(rng, values=name == "ppo")])  # SAC: 64 transitions, past learning_starts
    changed = [k for k, v in trained.core.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("actor.") for k in changed), changed

    published = {}

    def publish(version: int, blob: bytes, spec: dict) -> int:
        published.update(blob=blob, spec=spec)
        return version

    trained.core.publish_weights(publish)
    assert published["spec"]["network"] == USER
    policy = load_policy(published["spec"], published["blob"], torch.device("cpu"), network=USER)
    observations = rng.normal(size=(8, 3)).astype(np.float32)
    actions, log_probs, values = policy.act(observations)
    assert actions.shape == (8, 1) and np.all(np.abs(actions) <= 2.0) and np.isfinite(log_probs).all()
    if name == "ppo":  # the same network in both places: the rollout's values are the trainer's
        model = trained.core.model
        with torch.no_grad():
            expected = model.denormalize_value(
                model.normalized_value(model.normalize_obs(torch.as_tensor(observations)))
            )
        np.testing.assert_allclose(values, expected.numpy(), rtol=1e-5, atol=1e-5)
    else:
        assert values is None


def test_a_rollout_builds_only_the_network_its_config_names() -> None:
    trained = learner("ppo", USER)
    with pytest.raises(ValueError, match="this rollout's trainer.model.network is 'mlp'"):
        load_policy(trained.core.spec, trained.core.weights(), torch.device("cpu"))  # imports nothing


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ("no_such_package.nets:Net", "does not import: ModuleNotFoundError"),
        ("tests.support.user_networks:Missing", "does not import: AttributeError"),
        (
            "tests.support.user_networks:NotANetwork",
            "not a subclass of tinker_atropos.models.mlp.ActorCritic",
        ),
        (
            "tests.support.user_networks:WrongOutputs",
            r"its actor maps a batch of 2 observations to \(2, 1\), expected \(2, 2\)",
        ),
    ],
)
def test_a_network_that_cannot_serve_is_refused_in_one_line(network: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        learner("sac", network)  # SAC's actor gives a mean and a log standard deviation: 2 numbers


def test_the_config_refuses_what_is_not_an_import_path() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.model\.network.*'mlp' or 'module:Class'"):
        parse_config({"trainer": {"model": {"network": "my nets/conv.py"}}})
    assert build_network(learner("ppo", "mlp").core.spec).__class__.__name__ == "ActorCritic"


@pytest.mark.integration
def test_up_stops_in_one_line_when_the_trainer_cannot_build_its_network(tmp_path) -> None:
    resolved = yaml.safe_load((REPO / "configs" / "pendulum.yaml").read_text())
    resolved["trainer"]["model"]["network"] = "no_such_package.nets:Net"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(resolved))
    result = cli(
        "up", str(config), "--run-dir", str(tmp_path / "run"), "--total-steps", "100000", timeout=180
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "trainer.model.network 'no_such_package.nets:Net' does not import" in trainer_log
    assert "Traceback" not in trainer_log
