"""Small causal LMs of several transformers families, built here from a config with random weights (hidden 32, two
layers) and saved as Hugging Face folders with the tiny LM's byte tokenizer beside them: what
``trainer.tinker.base_models`` serves, without a download."""

from __future__ import annotations

from pathlib import Path

import torch

from tinker_atropos.models import tiny_lm

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma")


def model_folder(directory: Path, family: str, seed: int = 0) -> Path:
    """``directory`` holding a random ``family`` model of the byte tokenizer's vocabulary (258 tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tiny_lm.ByteTokenizer()
    config = AutoConfig.for_model(family, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  vocab_size=tokenizer.vocab_size, max_position_embeddings=256,
                                  bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                  pad_token_id=tokenizer.eos_id, tie_word_embeddings=family == "gemma")  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
