"""PPO's hyper-parameters: the ``trainer.ppo`` section of a run config. The clipped objective's fields are shared
with APPO (``ClippedObjectiveConfig``), which estimates advantages with V-trace instead of GAE.

Two brakes on an update, both off by default (the tuned configs were measured without them): ``anneal_lr``, the
learning rate going linearly to 0 as CleanRL's does by default (over its ``total_timesteps``, 1M for continuous
control; a run here has no fixed length, so the span is a field), and ``target_kl``, an update stopped once the
policy has moved that far (Stable-Baselines3 checks each minibatch, CleanRL each epoch; both default to none).
Either keeps a long run from undoing what it learned, as Pendulum with a constant 1e-3 does after 350-700k steps.
"""

from __future__ import annotations

from pydantic import Field

from tinker_atropos.sections import Section


class ClippedObjectiveConfig(Section):
    """The clipped-surrogate update, its optimiser and normalisers, whatever estimates the advantages."""

    learning_rate: float = Field(3e-4, gt=0, description="Adam step size (the first, with anneal_lr).")
    anneal_lr: bool = Field(
        False,
        description="Anneal the step size linearly from learning_rate to 0 over anneal_env_steps env steps "
        "learned from, as CleanRL does by default; off: constant, as in Stable-Baselines3.",
    )
    anneal_env_steps: int = Field(
        1_000_000,
        ge=1,
        description="Env steps the annealing spans (CleanRL's total_timesteps); past them the step size is 0 "
        "and the policy stops changing: set it to the run's length (up --total-steps).",
    )
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    clip_coef: float = Field(0.2, gt=0, description="PPO ratio clipping.")
    ent_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    vf_coef: float = Field(0.5, ge=0, description="Value loss weight.")
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    update_epochs: int = Field(10, ge=1, description="Passes over each batch.")
    num_minibatches: int = Field(32, ge=1, description="Minibatches per epoch.")
    target_kl: float | None = Field(
        None,
        gt=0,
        description="Stop an update at the first minibatch where the policy has moved more than this "
        "approximate KL from where the update began (checked before its step); null: never.",
    )
    normalize_advantages: bool = Field(True, description="Standardise advantages per minibatch.")
    normalize_observations: bool = Field(True, description="Running mean/std observation normaliser.")
    normalize_returns: bool = Field(
        True, description="Value head predicts returns standardised by running stats."
    )


class PPOConfig(ClippedObjectiveConfig):
    """Clipped-objective PPO with GAE, as CleanRL's ppo_continuous_action."""

    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
