"""An Atropos batch as Tinker datums: the same maths a Tinker client of the Atropos integration sends.

For each group, advantages are relative to the group: score − the group's mean score, so a group whose scores
are all equal teaches nothing and is skipped (counted). An env may send per-token ``advantages`` instead (used
as given), or zero a sequence's with ``overrides[i]["set_advantage_to_zero"]``. Each sequence becomes one datum:
inputs ``tokens[:-1]``, targets ``tokens[1:]``; positions whose ``masks`` entry is −100 (the prompt) weigh
nothing; the behaviour log-probs are ``inference_logprobs[1:]``, whose prompt positions hold atroposlib's
sentinel 1.0 and are zeroed here (their weight is 0 anyway). Advantages are divided by the batch's count of
trained tokens, so the summed Tinker loss is a per-token mean whatever the batch's lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinker_atropos.frontends.tinker.wire import Datum

MASKED = -100  # atroposlib's mask value for a position not to train on
SENTINEL_LOGPROB = 1.0  # atroposlib's inference log-prob at a prompt position


class BatchError(ValueError):
    """A group whose fields do not line up (a sequence without its mask, a log-prob list of another length)."""


@dataclass
class BatchDatums:
    data: list[Datum] = field(default_factory=list)
    groups_skipped_equal: int = 0  # every score the same: no signal
    scores: list[float] = field(default_factory=list)
    has_behaviour_logprobs: bool = True  # False when a sequence came without inference_logprobs


def group_advantages(scores: list[float], overrides: list[dict[str, Any]] | None) -> list[float] | None:
    """score − group mean per sequence (zeroed where an override says so); None when the scores are all equal."""
    if len(set(scores)) <= 1:
        return None
    mean = sum(scores) / len(scores)
    advantages = [s - mean for s in scores]
    for i, override in enumerate(overrides or []):
        if override and override.get("set_advantage_to_zero"):
            advantages[i] = 0.0
    return advantages


def batch_datums(batch: list[dict[str, Any]]) -> BatchDatums:
    """The datums of a batch from ``/batch``; BatchError for a malformed group."""
    out = BatchDatums()
    rows: list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray | None]] = []
    for g, group in enumerate(batch):
        tokens, masks, scores = group["tokens"], group["masks"], group["scores"]
        if not len(tokens) == len(masks) == len(scores):
            raise BatchError(f"group {g}: {len(tokens)} sequences, {len(masks)} masks, {len(scores)} scores")
        out.scores += scores
        given = group.get("advantages")
        advantages = None if given else group_advantages(scores, group.get("overrides"))
        if given is None and advantages is None:
            out.groups_skipped_equal += 1
            continue
        logprobs = group.get("inference_logprobs")
        for i, sequence in enumerate(tokens):
            if len(sequence) < 2 or len(masks[i]) != len(sequence):
                raise BatchError(
                    f"group {g} sequence {i}: {len(sequence)} tokens, {len(masks[i])} mask entries"
                )
            weights = (np.asarray(masks[i][1:]) != MASKED).astype(np.float32)
            if given is not None:
                if len(given[i]) != len(sequence):
                    raise BatchError(
                        f"group {g} sequence {i}: {len(given[i])} advantages for {len(sequence)} tokens"
                    )
                per_token = np.asarray(given[i][1:], np.float32) * weights
            else:
                per_token = np.float32(advantages[i]) * weights
            behaviour = None
            if logprobs is not None and logprobs[i] is not None:
                if len(logprobs[i]) != len(sequence):
                    raise BatchError(
                        f"group {g} sequence {i}: {len(logprobs[i])} log-probs for {len(sequence)} tokens"
                    )
                behaviour = np.where(weights > 0, np.asarray(logprobs[i][1:], np.float32), np.float32(0.0))
            rows.append((sequence, weights, per_token, behaviour))
    trained = max(1.0, float(sum(w.sum() for _, w, _, _ in rows)))
    for sequence, weights, per_token, behaviour in rows:
        inputs = {"target_tokens": np.asarray(sequence[1:], np.int64), "weights": weights,
                  "advantages": (per_token / trained).astype(np.float32)}  # fmt: skip
        if behaviour is not None:
            inputs["logprobs"] = behaviour.astype(np.float32)
        else:
            out.has_behaviour_logprobs = False
        out.data.append(Datum(tokens=np.asarray(sequence[:-1], np.int64), inputs=inputs))
    return out
