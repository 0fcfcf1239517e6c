"""A served language model's weights out of the run, in the formats the field loads (``models/hf_export.py``):
``peft``, its LoRA adapters as a PEFT adapter folder over its base's Hugging Face folder, or ``merged``, a Hugging
Face model folder with them folded in (a fully trained model: itself). ``tinker-atropos export`` writes either from a
checkpoint file; the API's ``save_weights_external`` writes the one that fits the model.

Only bases that are transformers models leave this way (SmolLM2, a Hugging Face folder): the tiny byte-level LM is
an architecture of ours that neither transformers nor PEFT knows, so its checkpoint (a torch state dict) is its only
format, and an export of it is refused with that reason rather than written in a form nothing else reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinker_atropos.models import hf_export, smollm2
from tinker_atropos.tinker_api.wire import WireError
from tinker_atropos.training.data import ClientError
from tinker_atropos.training.served import LANGUAGE_MODELS, LanguageModel, ServedModel

FORMATS = ("peft", "merged")


def transformers_model(model: ServedModel) -> nn.Module:
    """The transformers model inside a served LM; WireError for any other model."""
    hf = getattr(model.core.model, "hf", None)
    if not isinstance(model, LanguageModel) or hf is None:
        kind = "a control policy" if not isinstance(model, LanguageModel) else "an architecture of ours"
        raise WireError(
            f"{model.base_model} is {kind}, which neither transformers nor PEFT loads: its weights "
            "leave the run only as its checkpoint (save_state)"
        )
    return hf


def base_folder(model: ServedModel, hf: nn.Module) -> Path:
    """The Hugging Face folder the base was loaded from (what an adapter names, and a merged folder takes its
    tokenizer from); WireError when there is none on this machine."""
    candidates = [Path(str(getattr(hf.config, "_name_or_path", "") or "/nonexistent"))]
    if model.base_model == smollm2.NAME:  # read from its GGUF file in the process that converted it
        candidates.append(smollm2.cache_dir())
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder.resolve()
    raise WireError(
        f"{model.base_model} has no Hugging Face folder on this machine (looked in "
        f"{', '.join(map(str, candidates))}): an adapter needs its base's"
    )


def natural_format(model: ServedModel) -> str:
    """What ``save_weights_external`` writes: a LoRA model's adapter, a fully trained model whole."""
    return "peft" if isinstance(model, LanguageModel) and model.lora else "merged"


def write(model: ServedModel, fmt: str, out: Path) -> list[Path]:
    """``model``'s weights to the folder ``out`` in ``fmt``; the files written. WireError for a model or format
    that cannot be written so (one line)."""
    if fmt not in FORMATS:
        raise WireError(f"format {fmt!r} is not one of: {', '.join(FORMATS)}")
    hf = transformers_model(model)
    base = base_folder(model, hf)
    if fmt == "peft":
        if not model.lora:
            raise WireError(
                f"the model trained every weight of {model.base_model} (LoRA rank 0): it has no "
                "adapter; export it merged"
            )
        return hf_export.write_adapter(hf, out, str(base))
    return hf_export.write_merged(hf, out, base)


def from_checkpoint(state: dict[str, Any]) -> LanguageModel:
    """The model a Tinker checkpoint (``weights/`` or ``sampler_weights/``, as ``torch.load`` reads it) holds,
    rebuilt on the CPU; WireError when it is none of a served LM."""
    record = state.get("record") if isinstance(state, dict) else None
    if not isinstance(record, dict) or "model" not in state:
        raise WireError("not a Tinker checkpoint (no record of its base model)")
    base_model = record.get("base_model")
    if base_model not in LANGUAGE_MODELS:
        raise WireError(
            f"the checkpoint holds a {base_model}, not a language model: export control policies "
            "with --format onnx or pt2 (runs of `up`)"
        )
    if base_model == smollm2.NAME and not smollm2.available():
        raise WireError(f"{base_model} is not installed here (see docs/tinker.md, The Tinker API: Models)")
    try:
        model = LanguageModel(base_model, record.get("lora") or {}, torch.device("cpu"))
        model.load_model_state(state["model"])
    except ClientError as error:  # a LoRA record without targets, a state missing its adapters
        raise WireError(str(error)) from None
    except RuntimeError as error:  # torch's size mismatches, a line each: the first says enough
        first = str(error).strip().splitlines()[-1].strip()
        raise WireError(f"the checkpoint does not fit its record ({record.get('lora')}): {first}") from None
    return model
