"""A transformers causal LM trained here, out of the run: its LoRA adapters as a PEFT adapter folder, or the model
with them folded in as a Hugging Face model folder. Both load with nothing of ours (``transformers``, ``peft``).

Our ``LoRALinear`` is PEFT's LoRA layer under other names: ``base(x) + (alpha / rank) * x A^T B^T`` with A of shape
[rank, in] and B of shape [out, rank], as PEFT's ``lora_A.weight`` and ``lora_B.weight`` are, and PEFT scales by
``lora_alpha / r`` (``use_rslora`` off). So the adapter is the same tensors under PEFT's key names
(``base_model.model.<module path>.lora_A.weight``), with ``r`` and ``lora_alpha`` such that the scale is ours.

A merged folder is the base with ``W + scale * B A`` in each adapted Linear, written by ``save_pretrained``, beside
the base's tokenizer files. A tied unembedding (SmolLM2's) that LoRA adapted is untied first: folding the head's
adapter into the shared matrix would change the input embeddings too, which the served model never does.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from tinker_atropos.models.lora import LoRALinear, adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# what a base folder holds besides its weights and config: the tokenizer a merged folder carries along
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


def _rank_and_alpha(layers: dict[str, LoRALinear]) -> tuple[int, float]:
    ranks = {layer.lora_a.shape[0] for layer in layers.values()}
    scales = {layer.scale for layer in layers.values()}
    if len(ranks) != 1 or len(scales) != 1:  # lora.wrap gives every layer one rank and alpha
        raise ValueError(f"the adapters differ in rank {sorted(ranks)} or scale {sorted(scales)}")
    rank = ranks.pop()
    return rank, scales.pop() * rank


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` under PEFT's key names, float32 on the CPU."""
    state = {}
    for name, layer in adapter(model).items():
        state[f"base_model.model.{name}.lora_A.weight"] = layer.lora_a.detach().float().cpu().contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = layer.lora_b.detach().float().cpu().contiguous()
    return state


def adapter_config(model: nn.Module, base_path: str) -> dict[str, object]:
    """PEFT's ``LoraConfig`` of ``model``'s adapters, as ``adapter_config.json`` holds it."""
    layers = adapter(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters (trained fully: export it merged)")
    rank, alpha = _rank_and_alpha(layers)
    # a module's own name matches it at any depth; listing them sorted keeps the file the same run to run
    targets = sorted({name.rsplit(".", 1)[-1] for name in layers})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(model: nn.Module, out: Path, base_path: str) -> list[Path]:
    """``model``'s adapters as a PEFT adapter folder ``out`` (made if missing) over the base at ``base_path``;
    the files written."""
    config = adapter_config(model, base_path)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / ADAPTER_WEIGHTS
    safetensors.torch.save_file(adapter_state(model), str(weights), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return _ordinary_mode([out / ADAPTER_CONFIG, weights], out / ADAPTER_CONFIG)


def merged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose LoRA layers are plain Linear layers holding ``W + scale * B A`` (float32)."""
    copied = copy.deepcopy(model)
    # the tensors held outside the LoRA layers' bases: a base among them is a tied head's, the embeddings'
    held_elsewhere = {
        id(p)
        for name, p in copied.named_parameters(remove_duplicate=False)
        if not name.endswith("base.weight")
    }
    untied = False
    for name, layer in adapter(copied).items():
        base = layer.base
        untied |= id(base.weight) in held_elsewhere  # a tied head: it gets a matrix of its own
        folded = nn.utils.skip_init(  # no random init of a matrix about to be overwritten
            nn.Linear,
            base.in_features,
            base.out_features,
            bias=base.bias is not None,
            device=base.weight.device,
            dtype=base.weight.dtype,
        )
        with torch.no_grad():
            delta = layer.scale * (layer.lora_b.float() @ layer.lora_a.float())
            folded.weight.copy_(base.weight.float() + delta)
            if base.bias is not None:
                folded.bias.copy_(base.bias)
        parent_name, _, attribute = name.rpartition(".")
        setattr(copied.get_submodule(parent_name) if parent_name else copied, attribute, folded)
    if untied:
        copied.config.tie_word_embeddings = False
    return copied.requires_grad_(False)


def write_merged(model: nn.Module, out: Path, base_folder: Path | None) -> list[Path]:
    """``model`` with its adapters folded in (or as it is, trained fully) as a Hugging Face model folder ``out``,
    with the tokenizer files of ``base_folder``; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    merged(model).save_pretrained(out)
    if base_folder is not None:
        for name in _TOKENIZER_FILES:
            if (base_folder / name).exists() and not (out / name).exists():
                shutil.copyfile(base_folder / name, out / name)
    written = sorted(path for path in out.iterdir() if path not in before or path.is_file())
    return _ordinary_mode(written, out / "config.json")


def _ordinary_mode(files: list[Path], like: Path) -> list[Path]:
    """``files``, each given the mode of ``like``, a JSON file written with ``open`` (0644 under a umask of 022):
    safetensors writes its files 0600 whatever the umask (a temporary file renamed into place), which left an
    export's weights unreadable to those who may read the rest of it."""
    mode = like.stat().st_mode & 0o777
    for path in files:
        if path.is_file():
            path.chmod(mode)
    return files
