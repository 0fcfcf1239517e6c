"""One sample request as the engine carries it (vLLM's sequence group): its prompt's reading, each sample's tokens
so far and how it ended, and its future. The engine moves it from queue to queue; it records what is drawn."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tinker_atropos.models import lora
from tinker_atropos.sampling.params import Params, SampledTokens, Topk, TopRow, top

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: Params
    adapter: lora.Adapter | None
    deadline: float | None  # time.monotonic() past which it fails (time paused for training aside)
    future: Future[list[SampledTokens]]
    generators: list[torch.Generator] = field(default_factory=list)  # one per sample
    excused: float = 0.0  # seconds the engine paused while this request was in it
    tenant: str = ""  # whom its rows are accounted to (scheduler.py)
    submitted: float = field(default_factory=time.monotonic)
    kv: KV | None = None  # its prompt's, while it is read
    read: int = 0  # prompt tokens read
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    topk: list[list[TopRow | None]] = field(default_factory=list)  # per sample, per token
    ends: list[str | None] = field(default_factory=list)
    live: list[int] = field(default_factory=list)  # its samples still in the batch, in the batch's order

    @property
    def rows(self) -> int:
        """The batch rows it holds: its live samples once it decodes, all of them before."""
        return len(self.live) if self.live else self.params.num_samples

    def restart(self, device: torch.device) -> None:
        """Nothing read nor sampled, its seeded generators afresh: as it starts, and over again once preempted."""
        n = self.params.num_samples
        self.generators = self.params.generators(device)
        self.kv, self.read, self.live = None, 0, []
        self.tokens, self.logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        self.topk, self.ends = [[] for _ in range(n)], [None] * n

    @property
    def positions(self) -> int:
        """The positions each of its rows holds at most."""
        return len(self.prompt) + self.params.max_tokens

    def record(self, sample: int, token: int, logprob: float, topk: TopRow | None) -> bool:
        """A sample's new token (and the most likely ones of its step, when asked); whether the sample goes on."""
        tokens = self.tokens[sample]
        tokens.append(token)
        self.logprobs[sample].append(logprob)
        self.topk[sample].append(topk)
        params = self.params
        if token in params.stop_tokens or (params.stop_text is not None and params.stop_text(tokens)):
            self.ends[sample] = "stop"
        elif len(tokens) == params.max_tokens:
            self.ends[sample] = "length"
        return self.ends[sample] is None

    def result(self) -> list[SampledTokens]:
        k = self.params.topk_logprobs
        return [
            SampledTokens(t, lp, end, Topk(k, rows) if k else None)  # type: ignore[arg-type]
            for t, lp, end, rows in zip(self.tokens, self.logprobs, self.ends, self.topk, strict=True)
        ]

    def fail(self, error: BaseException) -> None:
        """Answer it with ``error``, unless it is answered already."""
        if not self.future.done():
            self.future.set_exception(error)

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw the first token of each sample from its prompt's last ``logits``: those of the samples that go on
        (answered when none does)."""
        n = self.params.num_samples
        tokens, logprobs = self.params.draw(logits.expand(n, -1), self.generators)
        topk = self.top(logits) * n  # the samples share the prompt's last step
        self.live = [
            s
            for s, t, lp, tk in zip(range(n), tokens.tolist(), logprobs.tolist(), topk, strict=True)
            if self.record(s, t, lp, tk)
        ]
        if not self.live:
            self.future.set_result(self.result())
        return tokens[self.live]

    def next(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Draw the next token of each live sample from its row of ``logits``: the tokens, and which of those rows
        go on (answered when none does)."""
        tokens, logprobs = self.params.draw(logits, [self.generators[s] for s in self.live])
        drawn = zip(self.live, tokens.tolist(), logprobs.tolist(), self.top(logits), strict=True)
        going = [row for row, (s, t, lp, tk) in enumerate(drawn) if self.record(s, t, lp, tk)]
        self.live = [self.live[row] for row in going]
        if not self.live:
            self.future.set_result(self.result())
        return tokens, going

    def top(self, logits: torch.Tensor) -> Sequence[TopRow | None]:
        """Per row of ``logits``, its ``Params.topk_logprobs`` most likely tokens (None each when not asked)."""
        k = self.params.topk_logprobs
        return top(logits, k) if k else [None] * len(logits)
