"""The APPO learner: PPO's learner with V-trace in place of GAE. Chunks acted by policies up to
``trainer.max_policy_lag`` versions old are corrected towards the current policy rather than dropped, so the
rollouts can collect flat out while the trainer learns."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tinker_atropos.algorithms.appo.learning import compute_vtrace
from tinker_atropos.algorithms.ppo.learner import PPOLearner
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.protocol.trajectory import Trajectory


class APPOLearner(PPOLearner):
    @torch.no_grad()
    def _current_policy(
        self, observations: np.ndarray, actions: np.ndarray, bootstrap_observations: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The current policy's log-probs of the run's actions, its values and its bootstrap values."""
        model: ActorCritic = self.core.model
        steps, instances = observations.shape[:2]
        device = self.core.device

        def flat(array: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(array.reshape(steps * instances, *array.shape[2:]), device=device)

        norm_obs = model.normalize_obs(flat(observations))
        log_probs = model.log_prob(model.distribution(norm_obs), flat(actions))
        values = model.denormalize_value(model.normalized_value(norm_obs))
        norm_bootstrap = model.normalize_obs(torch.as_tensor(bootstrap_observations, device=device))
        bootstrap = model.denormalize_value(model.normalized_value(norm_bootstrap))
        return (
            log_probs.reshape(steps, instances).cpu().numpy(),
            values.reshape(steps, instances).cpu().numpy(),
            bootstrap.cpu().numpy(),
        )

    def advantages(
        self, run: list[Trajectory], along_time: Callable[[str], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """V-trace over one run, with the current critic and the current policy against the acting one."""
        log_probs, values, bootstrap = self._current_policy(
            along_time("observations"), along_time("actions"), run[-1].bootstrap_observations
        )
        targets, advantages = compute_vtrace(
            along_time("log_probs"),
            log_probs,
            along_time("rewards"),
            values,
            along_time("terminated"),
            along_time("truncated"),
            along_time("truncation_values"),
            bootstrap,
            self.hp.gamma,
            self.hp.vtrace_rho_bar,
            self.hp.vtrace_c_bar,
            self.hp.vtrace_lambda,
        )
        return advantages, targets
