"""APPO's hyper-parameters: the ``trainer.appo`` section of a run config."""

from __future__ import annotations

from pydantic import Field

from tinker_atropos.algorithms.ppo.config import ClippedObjectiveConfig


class APPOConfig(ClippedObjectiveConfig):
    """The clipped objective over V-trace advantages and value targets (Espeholt et al. 2018). Few epochs, as in
    Sample Factory: the batch's data is already off-policy, and each pass moves the policy further from it."""

    update_epochs: int = Field(2, ge=1, description="Passes over each batch.")
    num_minibatches: int = Field(4, ge=1, description="Minibatches per epoch.")
    vtrace_rho_bar: float = Field(
        1.0, gt=0, description="Truncation of the importance weights in the TD errors (rho-bar)."
    )
    vtrace_c_bar: float = Field(
        1.0, gt=0, description="Truncation of the importance weights that carry errors back in time (c-bar)."
    )
    vtrace_lambda: float = Field(1.0, ge=0, le=1, description="Trace decay of the V-trace targets.")
