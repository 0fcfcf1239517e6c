"""SAC's hyper-parameters: the ``trainer.sac`` section of a run config (defaults as CleanRL's sac_continuous_action)."""

from __future__ import annotations

from pydantic import Field

from tinker_atropos.sections import Section


class SACConfig(Section):
    """Soft actor-critic with twin Q critics, Polyak-averaged targets and a tuned entropy temperature."""

    policy_learning_rate: float = Field(
        3e-4, gt=0, description="Adam step size of the actor and the temperature."
    )
    q_learning_rate: float = Field(1e-3, gt=0, description="Adam step size of the twin Q critics.")
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    tau: float = Field(
        0.005, gt=0, le=1, description="Polyak step of the target critics, every gradient step."
    )
    batch_size: int = Field(256, ge=1, description="Transitions sampled per gradient step.")
    buffer_size: int = Field(
        1_000_000,
        ge=1,
        description="Transitions the trainer's replay buffer holds (4 (2 obs_dim + action_dim + 1) + 1 bytes each); "
        "each checkpoint writes the ones added since the previous one (checkpoints/replay/).",
    )
    learning_starts: int = Field(
        5_000, ge=1, description="Transitions gathered before the first gradient step."
    )
    utd_ratio: float = Field(
        1.0,
        gt=0,
        description="Gradient steps per env step received (update-to-data). The trainer keeps it by taking new "
        "chunks only once it made their gradient steps; with rollout.flow_control 'pause' the rollouts wait.",
    )
    alpha: float | None = Field(
        None, gt=0, description="Fixed entropy temperature; None tunes it towards target_entropy."
    )
    target_entropy: float | None = Field(
        None, description="Entropy the tuned temperature aims at; None: minus the action dimensions."
    )
