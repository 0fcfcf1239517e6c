"""An Atropos batch as Tinker datums: the same maths a Tinker client of the Atropos integration sends.

For each group, advantages are relative to the group: score − the group's mean score, so a group whose scores
are all equal teaches nothing and is skipped (counted). An env may send per-token ``advantages`` instead (used
as given), or zero a sequence's with ``overrides[i]["set_advantage_to_zero"]``. Each sequence becomes one datum:
inputs ``tokens[:-1]``, targets ``tokens[1:]``; positions whose ``masks`` entry is −100 (the prompt) weigh
nothing; the behaviour log-probs are ``inference_logprobs[1:]``, whose prompt positions hold atroposlib's
sentinel 1.0 and are zeroed here (their weight is 0 anyway). Advantages are divided by the batch's count of
trained tokens, so the summed Tinker loss is a per-token mean whatever the batch's lengths.

A group the model cannot learn from (fields that do not line up, a score that is not a finite number, a token
outside the model's vocabulary, a sequence past its context: ``training.data.check_datum``) is skipped and counted with
its reason, and the batch's sound groups are learned from all the same.

What a batch tells besides its datums, the figures TRL and verl chart: its reward and answer length
(``BatchDatums.figures``), and against the learner's log-probs of the loss pass, how far sampler and learner lie
apart (``policy_figures``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinker_atropos.training.data import Datum, DatumError, Schema, check_datum

MASKED = -100  # atroposlib's mask value for a position not to train on
SENTINEL_LOGPROB = 1.0  # atroposlib's inference log-prob at a prompt position


class BatchError(ValueError):
    """A group whose fields do not line up (a sequence without its mask, a log-prob list of another length)."""


@dataclass
class BatchDatums:
    data: list[Datum] = field(default_factory=list)
    groups_skipped_equal: int = 0  # every score the same: no signal
    # why each group that could not be learned was skipped
    groups_invalid: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    # (score, trained tokens) of each sound sequence
    episodes: list[tuple[float, int]] = field(default_factory=list)
    has_behaviour_logprobs: bool = True  # False when a sequence came without inference_logprobs

    def figures(self) -> dict[str, float]:
        """Mean and spread of the reward over every sound answer (those of groups that scored alike too), and
        their mean length in trained tokens; empty for a batch without one."""
        if not self.episodes:
            return {}
        scores, lengths = np.array(self.scores), np.array([length for _, length in self.episodes])
        return {
            "score_mean": float(scores.mean()),
            "score_std": float(scores.std()),
            "answer_tokens_mean": float(lengths.mean()),
        }

    def answer_tokens(self) -> tuple[int, int]:
        """The trained tokens of every sound answer (what was sampled), and of those learned from."""
        learned = sum(int(d.inputs["weights"].sum()) for d in self.data)
        return sum(length for _, length in self.episodes), learned


def policy_figures(
    data: list[Datum], learner: list[np.ndarray], clip: tuple[float, float] | None
) -> dict[str, float]:
    """Sampler against learner over the trained tokens of ``data``, ``learner`` being each datum's log-probs as
    the loss pass computed them (before the step). ``kl_sampler_learner``: KL(sampler || learner) by the k3
    estimator, (r - 1) - log r with r = p_learner / p_sampler, unbiased on the sampler's tokens and never
    negative; ``entropy``: the sampler's, as the mean -log-prob of the tokens it sampled (an unbiased estimate
    that needs no pass over the vocabulary); with ``clip`` (PPO's ratio bounds), ``clip_fraction``: the tokens
    whose clipped term the loss takes (the ratio past the bound the advantage pushes it to), which give no
    gradient. A datum that came without the sampler's log-probs carries the learner's: it counts as agreeing."""
    trained = np.concatenate([d.inputs["weights"] for d in data]) > 0
    if not trained.any():
        return {}
    behaviour = np.concatenate([d.inputs["logprobs"] for d in data])[trained].astype(np.float64)
    log_ratio = np.concatenate(learner)[trained].astype(np.float64) - behaviour
    ratio = np.exp(log_ratio)
    figures = {
        "kl_sampler_learner": float(np.mean(ratio - 1.0 - log_ratio)),
        "entropy": float(-behaviour.mean()),
    }
    if clip is not None:
        advantages = np.concatenate([d.inputs["advantages"] for d in data])[trained]
        low, high = clip
        clipped = ((ratio > high) & (advantages > 0)) | ((ratio < low) & (advantages < 0))
        figures["clip_fraction"] = float(clipped.mean())
    return figures


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


def batch_datums(batch: list[Any], schema: Schema | None = None) -> BatchDatums:
    """The datums of a batch from ``/batch``; a group that is malformed or that ``schema`` (the model's) refuses is
    skipped, its reason kept."""
    out = BatchDatums()
    rows: list[Datum] = []
    for g, group in enumerate(batch):
        try:
            data, scores, equal = _group(group, schema)
        except (BatchError, DatumError, KeyError, TypeError, ValueError, OverflowError) as error:
            out.groups_invalid.append(f"group {g}: {error}")
            continue
        out.scores += scores
        trained = [sum(m != MASKED for m in mask) for mask in group["masks"]]
        out.episodes += list(zip(scores, trained, strict=True))
        if equal:
            out.groups_skipped_equal += 1
            continue
        rows += data
    trained = max(1.0, float(sum(d.inputs["weights"].sum() for d in rows)))
    for datum in rows:
        datum.inputs["advantages"] = (datum.inputs["advantages"] / trained).astype(np.float32)
        if "logprobs" not in datum.inputs:
            out.has_behaviour_logprobs = False
    out.data = rows
    return out


def _group(group: Any, schema: Schema | None) -> tuple[list[Datum], list[float], bool]:
    """A group's datums (advantages not yet divided by the batch's trained tokens), its scores, and whether they
    are all equal (no signal); BatchError or DatumError for a group no model could learn from."""
    tokens, masks, scores = group["tokens"], group["masks"], group["scores"]
    if not len(tokens) == len(masks) == len(scores) or not tokens:
        raise BatchError(f"{len(tokens)} sequences, {len(masks)} masks, {len(scores)} scores")
    scores = [float(s) for s in scores]
    if not all(math.isfinite(s) for s in scores):
        raise BatchError(f"scores {scores} are not all finite numbers")
    given = group.get("advantages")
    advantages = None if given else group_advantages(scores, group.get("overrides"))
    logprobs = group.get("inference_logprobs")
    data = []
    for i, sequence in enumerate(tokens):
        if len(sequence) < 2 or len(masks[i]) != len(sequence):
            raise BatchError(f"sequence {i}: {len(sequence)} tokens, {len(masks[i])} mask entries")
        weights = (np.asarray(masks[i][1:]) != MASKED).astype(np.float32)
        if given is not None:
            if len(given[i]) != len(sequence):
                raise BatchError(f"sequence {i}: {len(given[i])} advantages for {len(sequence)} tokens")
            per_token = np.asarray(given[i][1:], np.float32) * weights
        else:
            per_token = np.float32(0.0 if advantages is None else advantages[i]) * weights
        inputs = {
            "target_tokens": np.asarray(sequence[1:], np.int64),
            "weights": weights,
            "advantages": per_token.astype(np.float32),
        }
        if logprobs is not None and logprobs[i] is not None:
            if len(logprobs[i]) != len(sequence):
                raise BatchError(f"sequence {i}: {len(logprobs[i])} log-probs for {len(sequence)} tokens")
            behaviour = np.asarray(logprobs[i][1:], np.float32)
            inputs["logprobs"] = np.where(weights > 0, behaviour, np.float32(0.0)).astype(np.float32)
        datum = Datum(tokens=np.asarray(sequence[:-1], np.int64), inputs=inputs)
        if schema is not None:
            check_datum(schema, datum, i)
        data.append(datum)
    return data, scores, given is None and advantages is None
