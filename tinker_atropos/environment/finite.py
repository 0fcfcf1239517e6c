"""Non-finite values stop at the env service.

A simulator that blows up returns a NaN or an infinity once; passed on, it makes the trainer's parameters NaN and
every later action invalid, and the run stalls for good. ``FiniteGuard`` ends the episode of such an instance
instead: the step is reported as truncated (bootstrapped from the last finite observation, the one the policy
acted on), a non-finite reward counts as 0, the instance is reset, and the episode is reported with
``cut_nonfinite``. The other instances of the batch step on untouched.
"""

from __future__ import annotations

import numpy as np

from tinker_atropos.environment.backends.base import EnvBatch
from tinker_atropos.errors import EnvError
from tinker_atropos.protocol.steps import StepBatch


def _finite_rows(array: np.ndarray) -> np.ndarray:
    """Per row (instance): all of it finite."""
    return np.isfinite(array).reshape(len(array), -1).all(axis=1) if len(array) else np.ones(0, bool)


class FiniteGuard:
    """An EnvBatch's steps with every non-finite instance cut and reset; ``cut`` counts those episodes."""

    def __init__(self, batch: EnvBatch) -> None:
        self.batch = batch
        self.cut = 0
        self._last: np.ndarray | None = None  # the observations the latest actions were chosen on

    def reset(self, seed: int | None) -> np.ndarray:
        observations = self.batch.reset(seed)
        if not _finite_rows(observations).all():
            raise EnvError("the env returns a NaN or infinite observation right after reset")
        self._last = observations
        return observations

    def close(self) -> None:
        self.batch.close()

    def step(self, actions: np.ndarray) -> tuple[StepBatch, np.ndarray | None]:
        """The batch's step, and which instances were cut (None when all was finite, as nearly always)."""
        step = self.batch.step(actions)
        finite_obs = _finite_rows(step.observations)
        finite_rewards = np.isfinite(step.rewards)
        finite_finals = _finite_rows(step.final_observations)
        if finite_obs.all() and finite_rewards.all() and finite_finals.all():
            self._last = step.observations
            return step, None
        return self._repair(step, finite_obs, finite_rewards, finite_finals)

    def _repair(
        self, step: StepBatch, finite_obs: np.ndarray, finite_rewards: np.ndarray, finite_finals: np.ndarray
    ) -> tuple[StepBatch, np.ndarray]:
        assert self._last is not None, "step before reset"
        ended = np.zeros(len(step.rewards), dtype=bool)
        ended[step.final_indices] = True
        cut = ~finite_rewards | (~finite_obs & ~ended)
        cut[step.final_indices[~finite_finals]] = True
        going_on = cut & ~ended  # episodes the guard ends itself

        finals = dict(zip(step.final_indices.tolist(), step.final_observations, strict=True))
        for i in np.flatnonzero(going_on | (ended & cut)):
            if i not in finals or not np.isfinite(finals[i]).all():
                finals[int(i)] = self._last[i]
        observations = step.observations.copy()
        to_reset = np.flatnonzero(going_on | (ended & ~finite_obs))
        if to_reset.size:
            observations[to_reset] = self.batch.reset_instances(to_reset)
        if not _finite_rows(observations).all():
            raise EnvError("the env returns a NaN or infinite observation right after reset")

        order = sorted(finals)
        obs_shape = step.observations.shape[1:]
        self.cut += int(cut.sum())
        self._last = observations
        repaired = StepBatch(
            observations=observations,
            rewards=np.where(finite_rewards, step.rewards, 0.0).astype(np.float32),
            terminated=step.terminated,
            truncated=step.truncated | going_on,
            final_observations=(
                np.stack([finals[i] for i in order]).astype(np.float32, copy=False)
                if order
                else np.zeros((0, *obs_shape), np.float32)
            ),
            final_indices=np.asarray(order, dtype=np.int32),
        )
        return repaired, cut
