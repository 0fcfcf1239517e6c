"""What a sample request asks (``Params``), how its tokens are drawn from a model's logits, and when a sample ends:
the maths every front-end's sampling shares, whichever batch its rows run in."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch


class Decoder(Protocol):
    """What the engine decodes with: a causal LM that takes keys and values back (the tiny LM, any transformers
    LM through ``smollm2.SmolLM2``'s wrapper)."""

    config: Any  # max_seq_len, vocab_size
    eos_id: int

    def step(
        self, tokens: torch.Tensor, past: Any, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The logits [B, vocab] after ``tokens`` [B, T] at ``positions`` [B, T], following ``past`` (per layer,
        keys and values [B, heads, P, head_dim], or None), and the keys and values with theirs. ``mask``
        [B, P + T] marks the real positions (left padding off), None when all are."""
        ...


# a position's most likely token ids and their log-probs, most likely first
TopRow = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Topk:
    """The ``k`` most likely next tokens at each of a run of positions, with their log-probabilities under the
    model's own distribution (temperature 1, nothing cut); None where nothing was scored. What the Tinker SDK's
    top-k log-probs carry: a distillation recipe trains on a teacher's."""

    k: int
    rows: list[TopRow | None]


def top(logits: torch.Tensor, k: int) -> list[TopRow]:
    """``Topk`` rows of ``logits`` [N, vocab]: each row's ``k`` most likely tokens and their log-probabilities at
    temperature 1 (the distribution prompt log-probs are scored under, whatever a sample was drawn at)."""
    values, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


@dataclass(frozen=True)
class SampledTokens:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["length", "stop"]
    topk: Topk | None = None  # one row per token when ``Params.topk_logprobs`` asked for them


@dataclass(frozen=True)
class Params:
    """A request's sampling parameters, as the Tinker SDK's ``SamplingParams`` and an OpenAI request give them.

    Each sample ends after ``max_tokens`` tokens ("length"), or at the first token in ``stop_tokens`` ("stop"; that
    token is included). ``stop_text`` ends a sample too, at the first token after which it holds for the sample's
    tokens (a stop string in their decoded text; that token included, as a stop token is). ``logprobs`` are those
    of the distribution actually sampled from: the logits divided by ``temperature``, cut to ``top_k`` / ``top_p``
    and renormalised (what an importance ratio needs). ``temperature == 0`` is greedy, its logprobs those of
    temperature 1. ``top_k <= 0`` and ``top_p == 1`` keep every token. A given ``seed`` reproduces the samples.
    ``topk_logprobs`` > 0 also gives, for each token, that many most likely tokens of the step it was drawn at
    (``Topk``: the model's distribution at temperature 1, as prompt log-probs)."""

    max_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    stop_text: Callable[[Sequence[int]], bool] | None = None
    seed: int | None = None
    topk_logprobs: int = 0

    def check(self, prompt: Sequence[int], limits: Any) -> None:
        """ValueError, saying why, for a request the model cannot serve."""
        if not prompt:
            raise ValueError("prompt is empty")
        if self.max_tokens < 1 or self.num_samples < 1:
            raise ValueError(
                f"max_tokens and num_samples must be >= 1, got {self.max_tokens} and {self.num_samples}"
            )
        if len(prompt) + self.max_tokens > limits.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {self.max_tokens} exceeds "
                f"max_seq_len {limits.max_seq_len}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature} and {self.top_p}"
            )
        if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
            raise ValueError(f"token ids must be in [0, {limits.vocab_size})")
        if not 0 <= self.topk_logprobs <= limits.vocab_size:
            raise ValueError(
                f"topk_sample_logprobs must lie in [0, {limits.vocab_size}] (the vocabulary), "
                f"got {self.topk_logprobs}"
            )

    def generators(self, device: torch.device) -> list[torch.Generator]:
        """One per sample: a sample's tokens depend on its seed and its index alone, not on which other samples
        stopped before it or shared its batch."""
        generators = []
        for index in range(self.num_samples):
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(hash((int(self.seed), index)) % 2**63)
            generators.append(generator)
        return generators

    def draw(
        self, logits: torch.Tensor, generators: Sequence[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A token for each row of ``logits`` [N, vocab] (row i drawn with ``generators[i]``) and its
        log-probability under the distribution sampled from."""
        logprobs = sampling_logprobs(logits.float(), self.temperature, self.top_k, self.top_p)
        if self.temperature == 0:
            token = logprobs.argmax(-1, keepdim=True)
        else:
            # inverse transform sampling: one uniform per row from the row's own generator, then every row's token
            # found in one batched search of its cumulative distribution (a multinomial call per row took a fifth
            # of a 64-row decode step); a zero-probability token is never found, but where float rounding of
            # the total runs off the end: the most likely token then
            uniform = torch.stack(
                [torch.rand((), generator=g, device=g.device, dtype=torch.float64) for g in generators]
            ).to(logprobs.device)
            cdf = logprobs.double().exp().cumsum(-1)
            token = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
            token = token.clamp_(max=cdf.shape[-1] - 1)
            token = torch.where(
                logprobs.gather(-1, token).isneginf(), logprobs.argmax(-1, keepdim=True), token
            )
        return token.squeeze(1), logprobs.gather(-1, token).squeeze(1)


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities [N, vocab] of the distribution a sample draws from."""
    if temperature == 0:
        return logits.log_softmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p < 1:
        # keep the smallest set of most likely tokens whose mass reaches top_p: drop a token once the mass
        # of those before it already does (the most likely token always stays)
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.log_softmax(-1)


def stop_strings(
    strings: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> Callable[[Sequence[int]], bool] | None:
    """``Params.stop_text`` for stop strings: whether one of them is in the text ``decode`` makes of the tokens
    sampled so far (None without strings)."""
    if not strings:
        return None

    def reached(tokens: Sequence[int]) -> bool:
        text = decode(tokens)
        return any(s in text for s in strings)

    return reached
