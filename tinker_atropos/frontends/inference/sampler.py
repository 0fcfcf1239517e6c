"""The weights the inference endpoint samples with: a copy of the trainer's model, replaced whole after each
optimizer step, so a request never sees a half-updated network and every sample names the policy version it
came from. A LoRA model's copy holds the frozen base's own tensors (``shared``): a step copies its adapters only."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tinker_atropos.frontends.inference.tokens import ByteTokens, Tokens
from tinker_atropos.sampling import engine, requests
from tinker_atropos.sampling.requests import Params


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of sequence or a stop token/string) or "length"
    policy_version: int


class Sampler:
    """``model`` (a ``requests.Decoder``: the tiny LM, SmolLM2, a model folder's LM) served with ``tokenizer``;
    ``shared``: its tensors that never change (a LoRA model's base), held by every copy rather than copied."""

    def __init__(self, model: requests.Decoder, version: int = 0, tokenizer: Tokens | None = None,
                 shared: Iterable[torch.Tensor] = ()) -> None:  # fmt: skip
        self._lock = threading.Lock()
        self._shared = list(shared)
        self._model, self.version = self._frozen(model), version
        self.tokenizer = tokenizer or ByteTokens()
        self.max_seq_len = model.config.max_seq_len

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        frozen = copy.deepcopy(model, memo={id(t): t for t in self._shared}).eval()
        frozen.requires_grad_(False)
        return frozen

    def update(self, model: torch.nn.Module, version: int) -> None:
        """Serve ``model``'s current weights (copied) as ``version`` from the next request on."""
        frozen = self._frozen(model)
        with self._lock:
            self._model, self.version = frozen, version

    def generate(self, prompt: Sequence[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                 top_k: int, stop_tokens: Sequence[int], stop_strings: Sequence[str], seed: int | None) -> list[Completion]:  # fmt: skip
        """``n`` continuations of ``prompt``; ValueError for a request the model cannot serve. A completion ends
        at the end-of-sequence token (as an OpenAI server's always does) or one of ``stop_tokens``; a stop string
        ends it where its text first contains it (included, as a stop token is)."""
        with self._lock:
            model, version = self._model, self.version
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.max_seq_len}")
        params = Params(min(max_tokens, room), n, temperature, top_k, top_p, frozenset([*self.tokenizer.eos_ids, *stop_tokens]),
                        requests.stop_strings(stop_strings, self.tokenizer.decode), seed)  # fmt: skip
        samples = engine.sample(model, prompt, params)
        return [Completion(s.tokens, s.logprobs, s.stop_reason, version) for s in samples]
