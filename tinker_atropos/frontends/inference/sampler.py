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
from tinker_atropos.sampling import engine
from tinker_atropos.sampling.params import Decoder, Params
from tinker_atropos.sampling.params import stop_strings as text_stops


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of sequence or a stop token/string) or "length"
    policy_version: int


class Sampler:
    """``model`` (a ``Decoder``: the tiny LM, SmolLM2, a model folder's LM) served with ``tokenizer``;
    ``shared``: its tensors that never change (a LoRA model's base), held by every copy rather than copied.

    Each policy version decodes in a continuous-batching engine of its own (``sampling/engine.py``): concurrent
    requests share its running batch, and a request finishes with the version it started with; an older version's
    engine closes once its last request is answered."""

    def __init__(
        self,
        model: Decoder,
        version: int = 0,
        tokenizer: Tokens | None = None,
        shared: Iterable[torch.Tensor] = (),
        kv_tokens: int = 32_768,
        prefill_chunk: int = 256,
    ) -> None:
        self._lock = threading.Lock()
        self._shared = list(shared)
        self._settings = {
            "kv_tokens": kv_tokens,
            "prefill_chunk": prefill_chunk,
            "budget_name": "trainer.tinker.kv_cache_tokens",
        }
        self._engine, self.version = self._serving(model, version), version
        self._retired = engine.Retired()
        self.tokenizer = tokenizer or ByteTokens()
        self.max_seq_len = model.config.max_seq_len

    @property
    def model(self) -> torch.nn.Module:
        """The frozen copy the current version samples with."""
        with self._lock:
            return self._engine.decoder  # type: ignore[return-value]

    def _serving(self, model: torch.nn.Module, version: int) -> engine.Engine:
        frozen = copy.deepcopy(model, memo={id(t): t for t in self._shared}).eval()
        frozen.requires_grad_(False)
        served = engine.Engine(frozen, **self._settings)
        served.start(f"inference v{version}")
        return served

    def update(self, model: torch.nn.Module, version: int) -> None:
        """Serve ``model``'s current weights (copied) as ``version`` from the next request on."""
        served = self._serving(model, version)
        with self._lock:
            self._retired.add(self._engine)
            self._engine, self.version = served, version
        self._retired.close_idle()

    def close(self) -> None:
        with self._lock:
            engines = [self._engine, *self._retired.all()]
        for served in engines:
            served.close()

    def generate(
        self,
        prompt: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_tokens: Sequence[int],
        stop_strings: Sequence[str],
        seed: int | None,
        tenant: str = "",
    ) -> list[Completion]:
        """``n`` continuations of ``prompt``; ValueError for a request the model cannot serve. A completion ends
        at the end-of-sequence token (as an OpenAI server's always does) or one of ``stop_tokens``; a stop string
        ends it where its text first contains it (included, as a stop token is)."""
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.max_seq_len}")
        stops = frozenset([*self.tokenizer.eos_ids, *stop_tokens])
        text_stop = text_stops(stop_strings, self.tokenizer.decode)
        params = Params(min(max_tokens, room), n, temperature, top_k, top_p, stops, text_stop, seed)
        with self._lock:
            served, version = self._engine, self.version
        samples = served.submit(prompt, params, tenant=tenant).result()
        if served is not self._engine:
            self._retired.close_idle()
        return [Completion(s.tokens, s.logprobs, s.stop_reason, version) for s in samples]
