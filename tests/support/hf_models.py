"""Small causal LMs of several transformers families, built here from a config with random weights (hidden 32, two
layers) and saved as Hugging Face folders with the tiny LM's byte tokenizer beside them: what
``trainer.tinker.base_models`` serves, without a download; folders that only look servable (a BERT model, code of
its own); and the log-probabilities transformers gives of a model exported from a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tinker_atropos.models import tiny_lm

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma")


def model_folder(directory: Path, family: str, seed: int = 0) -> Path:
    """``directory`` holding a random ``family`` model of the byte tokenizer's vocabulary (258 tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tiny_lm.ByteTokenizer()
    config = AutoConfig.for_model(
        family,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.eos_id,
        tie_word_embeddings=family == "gemma",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def transformers_logprobs(model: torch.nn.Module, tokens: list[int], targets: list[int]) -> np.ndarray:
    """log p(targets[t] | tokens[:t+1]) through a transformers (or PEFT) model: what an exported model is checked
    against the server's with."""
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(targets)), torch.tensor(targets)].numpy()


def bert_folder(directory: Path, head: str) -> Path:
    """``directory`` holding a random BERT model saved as transformers' class ``head`` (``BertForMaskedLM``, the
    encoder BERT is; ``BertLMHeadModel``, which transformers lists among its causal LMs) with the byte tokenizer:
    config, weights and tokenizer all readable, yet no decoder-only causal LM."""
    import transformers

    tokenizer = tiny_lm.ByteTokenizer()
    config = transformers.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=256,
    )
    getattr(transformers, head)(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def custom_code_folder(directory: Path, marker: Path) -> Path:
    """``directory`` holding a model folder of a model type transformers does not know, whose ``auto_map`` names
    code of its own beside it; that code, if ever imported, writes ``marker`` (with its process's id)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps(
            {
                "model_type": "planted",
                "architectures": ["PlantedForCausalLM"],
                "auto_map": {
                    "AutoConfig": "configuration_planted.PlantedConfig",
                    "AutoModelForCausalLM": "modeling_planted.PlantedForCausalLM",
                },
            }
        )
    )
    code = f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
    (directory / "configuration_planted.py").write_text(
        code + "from transformers import PretrainedConfig\n\n\n"
        "class PlantedConfig(PretrainedConfig):\n    model_type = 'planted'\n"
    )
    (directory / "modeling_planted.py").write_text(code)
    tiny_lm.ByteTokenizer().save_pretrained(directory)
    return directory
