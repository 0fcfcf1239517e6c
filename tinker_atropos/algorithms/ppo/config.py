"""PPO's hyper-parameters: the ``trainer.ppo`` section of a run config. The clipped objective's fields are shared
with APPO (``ClippedObjectiveConfig``), which estimates advantages with V-trace instead of GAE."""

from __future__ import annotations

from pydantic import Field

from tinker_atropos.config import Section


class ClippedObjectiveConfig(Section):
    """The clipped-surrogate update, its optimiser and normalisers, whatever estimates the advantages."""

    learning_rate: float = Field(3e-4, gt=0, description="Adam step size.")
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    clip_coef: float = Field(0.2, gt=0, description="PPO ratio clipping.")
    ent_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    vf_coef: float = Field(0.5, ge=0, description="Value loss weight.")
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    update_epochs: int = Field(10, ge=1, description="Passes over each batch.")
    num_minibatches: int = Field(32, ge=1, description="Minibatches per epoch.")
    target_kl: float | None = Field(None, gt=0, description="Stop the epochs early past this approximate KL.")
    normalize_advantages: bool = Field(True, description="Standardise advantages per minibatch.")
    normalize_observations: bool = Field(True, description="Running mean/std observation normaliser.")
    normalize_returns: bool = Field(
        True, description="Value head predicts returns standardised by running stats."
    )


class PPOConfig(ClippedObjectiveConfig):
    """Clipped-objective PPO with GAE, as CleanRL's ppo_continuous_action."""

    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
