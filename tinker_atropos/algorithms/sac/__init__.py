"""SAC (soft actor-critic, automatic entropy temperature): ``config`` (its section), ``learning`` (the maths, top
to bottom), ``learner`` (chunks into the replay buffer, gradient steps at the configured ratio out). Registering it
imports neither torch nor the learner."""

from tinker_atropos.algorithms.base import Algorithm, register
from tinker_atropos.algorithms.sac.config import SACConfig

SAC = register(
    Algorithm(
        name="sac",
        hyperparameters=SACConfig,
        learner="tinker_atropos.algorithms.sac.learner:SACLearner",
        description="Soft actor-critic, off-policy with a replay buffer in the trainer, for bounded Box actions",
    )
)
