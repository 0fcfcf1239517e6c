"""What the Atropos loop tells of each optimizer step beyond its counters, in its status (``up``'s progress and
``metrics.jsonl``) and in TensorBoard (``tensorboard.LANGUAGE_MODEL_TAGS``): the batch's reward and answer length,
how far sampler and learner lie apart, the gradient norm, and the answer tokens sampled and learned from per second
of wall time."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from tinker_atropos.trainer.tensorboard import EVALUATION, TensorBoardLog, language_model_points
from tinker_atropos.training.atropos_batches import BatchDatums, policy_figures
from tinker_atropos.training.data import Datum
from tinker_atropos.training.losses import CLIP_HIGH, CLIP_LOW


def gradient_norm(model: torch.nn.Module) -> float:
    """The global norm of ``model``'s accumulated gradients, as a clipped step measures it before clipping: an
    unclipped step's, so that the curve is there whether the loop clips or not."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, foreach=True)) if grads else 0.0


class StepCurves:
    """The figures of the steps of a loop learning with ``loss``, written to ``log`` (None: TensorBoard is off)."""

    def __init__(self, log: TensorBoardLog | None, loss: str) -> None:
        self.log = log
        self.clip = (CLIP_LOW, CLIP_HIGH) if loss == "ppo" else None  # the loop passes no bounds of its own
        self._last_step: float | None = None  # when the last step ended
        self._evaluations: dict[str, float] = {}  # the eval/ figures last written

    def learned(
        self, data: list[Datum], learner: list[np.ndarray], metrics: Mapping[str, float]
    ) -> dict[str, float]:
        """A step that stood: its loss, its gradient norm (before any clipping) and how far the sampler's
        log-probs lay from ``learner``'s, those of the loss pass."""
        figures = {"loss": metrics["loss:sum"], **policy_figures(data, learner, self.clip)}
        if "grad_norm" in metrics:
            figures["grad_norm"] = metrics["grad_norm"]
        return figures

    def ended(self, datums: BatchDatums, stood: bool, started: float) -> dict[str, float]:
        """A step on ``datums`` that began at ``started`` (``time.monotonic``) ended now (``stood``: it was not
        undone): how long it took, and the answer tokens sampled and learned from per second since the last step
        ended, the wait for the batch included (the loop's throughput; not at its first step, which has nothing to
        be measured from)."""
        now = time.monotonic()
        last, self._last_step = self._last_step, now
        figures = {"step_seconds": now - started}
        if last is None:
            return figures
        sampled, learned = datums.answer_tokens()
        span = max(now - last, 1e-9)
        return figures | {
            "sampled_tokens_per_s": sampled / span,
            "trained_tokens_per_s": (learned if stood else 0) / span,
        }

    def write(self, step: int, figures: Mapping[str, float], fresh: Mapping[str, float]) -> None:
        """This step's figures (``fresh``) at ``step``, and each evaluation figure of ``figures`` (an evaluation
        sets them when it ends) that changed since it was last written."""
        if self.log is None:
            return
        evaluations = {
            name: value
            for name, value in figures.items()
            if name.startswith(EVALUATION) and self._evaluations.get(name) != value
        }
        self._evaluations |= evaluations
        self.log.add_step(language_model_points({**fresh, **evaluations}), step)
