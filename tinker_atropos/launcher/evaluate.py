"""Evaluate a run's policy: a checkpoint's weights acting on fresh instances of the run's env.

Training curves report the returns of exploring policies (sampled actions); what a user ships is usually the
mode. This loads the policy from a checkpoint, the run folder's newest by default (no service, no Redis
needed), steps the env's backend in-process, and reports the returns of whole episodes. Each instance plays an equal share of the
episodes, as SB3's ``evaluate_policy`` does, so short episodes are not over-counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tinker_atropos.config import Config
from tinker_atropos.environment.backends.base import make_env_batch
from tinker_atropos.environment.episodes import EpisodeTracker, equal_shares
from tinker_atropos.environment.spaces import check_actions
from tinker_atropos.launcher.run_folder import RunPolicy, run_policy
from tinker_atropos.models.acting import InferencePolicy


@dataclass(frozen=True)
class Evaluation:
    episodes: int
    return_mean: float
    return_std: float
    return_min: float
    return_max: float
    length_mean: float
    policy_version: int
    deterministic: bool
    checkpoint: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def acting_policy(
    config: Config, run_dir: Path, checkpoint: Path | None, seed: int
) -> tuple[InferencePolicy, RunPolicy]:
    """The policy of ``checkpoint`` (or the run's newest) as the rollouts act with it, on the CPU."""
    found = run_policy(run_dir, checkpoint, config.trainer.model.network)
    return InferencePolicy.of_model(found.model, "cpu", np.random.default_rng(seed)), found


def evaluate(
    config: Config,
    run_dir: Path,
    episodes: int,
    deterministic: bool = True,
    seed: int = 0,
    checkpoint: Path | None = None,
    instances: int = 8,
) -> Evaluation:
    """Play ``episodes`` episodes with the policy of ``checkpoint``, or of ``run_dir``'s newest checkpoint;
    FatalError when there is none or it holds no policy."""
    policy, found = acting_policy(config, run_dir, checkpoint, seed)
    num = min(instances, episodes)
    owed = equal_shares(episodes, num)
    env = make_env_batch(config.env.backend, config.env.id, config.env.kwargs, num)
    returns: list[float] = []
    lengths: list[int] = []
    try:
        obs, tracker = env.reset(seed), EpisodeTracker(num)
        while owed.any():
            actions, _, _ = policy.act(obs, deterministic=deterministic)
            step = env.step(check_actions(actions, env.action_space, num))
            for end in tracker.update(step.rewards, step.terminated, step.truncated):
                if owed[end.instance] > 0:
                    owed[end.instance] -= 1
                    returns.append(end.episode_return)
                    lengths.append(end.length)
            obs = step.observations
    finally:
        env.close()
    values = np.asarray(returns)
    return Evaluation(
        episodes=len(returns),
        return_mean=float(values.mean()),
        return_std=float(values.std()),
        return_min=float(values.min()),
        return_max=float(values.max()),
        length_mean=float(np.mean(lengths)),
        policy_version=found.version,
        deterministic=deterministic,
        checkpoint=str(found.checkpoint),
    )
