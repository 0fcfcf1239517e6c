"""The algorithm seam: PPO through the training core is the PPO of before, bit for bit; the services know no
algorithm; a second algorithm from outside the package trains through `up`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import redis
import torch
import yaml

from tests.support.records import serialized_chunk
from tests.support.running import REPO, Sidecar, assert_learned, report_rows, run_up_with
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.algorithms.ppo.learning import Batch, ppo_loss
from tinker_atropos.config import parse_config
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.protocol.trajectory import TrajectorySpec, decode_trajectory
from tinker_atropos.state import keys


def fused_ppo_update(model: ActorCritic, optimizer, batch: Batch, hp, generator: torch.Generator) -> None:
    """PPO's update as it was written before the training core split it (commit 639cc0e): loss, backward,
    clipping and Adam in one loop. The oracle the split is checked against."""
    if model.spec["normalize_observations"]:
        model.obs_rms.update(batch.observations.flatten(1))
    if model.spec["normalize_returns"]:
        model.return_rms.update(batch.returns)
    batch = replace(
        batch,
        observations=model.normalize_obs(batch.observations),
        returns=model.normalize_return(batch.returns),
    )
    size = batch.observations.shape[0]
    minibatch = max(1, size // hp.num_minibatches)
    for _epoch in range(hp.update_epochs):
        shuffled = batch.rows(torch.randperm(size, generator=generator))
        for start in range(0, size - minibatch + 1, minibatch):
            loss, stats = ppo_loss(model, shuffled.rows(slice(start, start + minibatch)), hp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm, foreach=True)
            optimizer.step()
        if hp.target_kl is not None and stats["approx_kl"] > hp.target_kl:
            break


def test_ppo_through_the_training_core_is_the_fused_update_bit_for_bit() -> None:
    config = parse_config(
        {"trainer": {"ppo": {"update_epochs": 3, "num_minibatches": 4, "learning_rate": 3e-3}}}
    )
    spaces = gym.spaces.Box(-np.inf, np.inf, (3,)), gym.spaces.Box(-2, 2, (1,))
    setup = LearnerSetup(*spaces, config.trainer, config.trainer.hyperparameters, torch.device("cpu"), seed=5)
    learner = PPOLearner(setup)
    hp = config.trainer.hyperparameters
    torch.manual_seed(5)  # the reference, built as the learner was before the split
    reference = ActorCritic(learner.core.spec)
    optimizer = torch.optim.Adam(reference.parameters(), lr=hp.learning_rate, eps=1e-5, fused=True)
    generator = torch.Generator().manual_seed(5)
    spec = TrajectorySpec.from_spaces(*spaces)
    for update in range(4):
        chunks = [decode_trajectory(serialized_chunk(4, 10 * update + i, length=16), spec) for i in range(2)]
        batch = learner.batch(chunks)
        learner.learn(chunks)
        fused_ppo_update(reference, optimizer, batch, hp, generator)
    ours, theirs = learner.core.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [
        k for k in ours if not torch.equal(ours[k], theirs[k])
    ]
    moments = [
        (learner.core.optimizer.state[a], optimizer.state[b])
        for a, b in zip(learner.core.model.parameters(), reference.parameters(), strict=True)
    ]
    assert all(
        torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
        for x, y in moments
    )


class ChunkSampler(Sidecar):
    """Decodes experience records as they are appended (a blocked XREAD gets each new entry, also one the
    trainer takes at once) and notes whether they carry values."""

    def __init__(self, client: redis.Redis, run: str, spec: TrajectorySpec) -> None:
        super().__init__(interval_s=0.01)
        self.client, self.key, self.spec, self.carried_values = client, keys.experience(run), spec, set()

    def work(self) -> None:
        for _, entries in self.client.xread({self.key: "$"}, count=1, block=200) or []:
            for _, fields in entries:
                self.carried_values.add(decode_trajectory(fields[b"record"], self.spec).has_values)


@pytest.mark.integration
def test_a_toy_algorithm_from_the_test_tree_learns_cartpole_through_up(
    tmp_path: Path, valkey, redis_client: redis.Redis
) -> None:
    config = yaml.safe_load((REPO / "configs" / "cartpole.yaml").read_text())
    config["run"] |= {"name": "toy", "report_interval_s": 0.5}  # an early row, before learning took off
    trainer = config["trainer"]
    del trainer["ppo"]
    # REINFORCE has no correction for data of an older policy: learn from the current one only
    trainer |= {
        "algorithm": "tests.support.toy_algorithm:toy_pg",
        "toy_pg": {"learning_rate": 0.003},
        "max_policy_lag": 0,
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(config))
    cartpole = gym.make("CartPole-v1")
    sampler = ChunkSampler(
        redis_client, "toy", TrajectorySpec.from_spaces(cartpole.observation_space, cartpole.action_space)
    )
    run_dir = tmp_path / "run"
    options = ("--redis-url", valkey.url, "--total-steps", "150000", "--target-return", "150")
    run_up_with(sampler, path, run_dir, *options)

    rows = report_rows(run_dir)
    # random play is ~22; 5 seeds took 48-68k steps. The first row comes half a second in, on a fast hour after a
    # few updates already (57.6 seen): a start below 100 is still far from the target 150 and from a trained 500
    assert_learned(rows, random_below=100.0, target=150.0, budget=150_000)
    assert rows[-1]["policy_version"] >= 10
    assert sampler.carried_values == {False}  # an actor-only policy: the chunks travel without values
    assert not any(k.startswith("records_rejected_") for k in rows[-1]["counters"])
    assert "toy_pg" in (run_dir / "config.yaml").read_text()
