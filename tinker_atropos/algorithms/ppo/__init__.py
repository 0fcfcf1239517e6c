"""PPO (clipped objective, GAE): ``config`` (its section), ``learning`` (the maths, top to bottom), ``learner``
(trajectories in, updates of the training core out). Registering it imports neither torch nor the learner."""

from tinker_atropos.algorithms.base import Algorithm, register
from tinker_atropos.algorithms.ppo.config import PPOConfig

PPO = register(
    Algorithm(
        name="ppo",
        hyperparameters=PPOConfig,
        learner="tinker_atropos.algorithms.ppo.learner:PPOLearner",
        description="Proximal policy optimisation, on-policy, for Box and Discrete actions",
    )
)
