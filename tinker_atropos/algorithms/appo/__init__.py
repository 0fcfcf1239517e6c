"""APPO (asynchronous PPO with V-trace, IMPALA's off-policy correction, as in Sample Factory): ``config`` (its
section), ``learning`` (V-trace, top to bottom), ``learner`` (trajectories of lagging policies in, updates out).
Registering it imports neither torch nor the learner."""

from tinker_atropos.algorithms.appo.config import APPOConfig
from tinker_atropos.algorithms.base import Algorithm, register

APPO = register(
    Algorithm(
        name="appo",
        hyperparameters=APPOConfig,
        learner="tinker_atropos.algorithms.appo.learner:APPOLearner",
        description="Asynchronous PPO with V-trace targets: learns from chunks of older policies, corrected",
    )
)
