"""A served language model's weights out of the run, in the formats the field loads (``models/hf_export.py``):
``peft``, its LoRA adapters as a PEFT adapter folder over its base's Hugging Face folder, or ``merged``, a Hugging
Face model folder with them folded in (a fully trained model: itself). ``tinker-atropos export`` writes either from a
checkpoint file of the Tinker API or of the Atropos loop (``from_checkpoint``: one reader of both); the API's
``save_weights_external`` writes the one that fits the model.

Only bases that are transformers models leave this way (SmolLM2, a Hugging Face folder): the tiny byte-level LM is
an architecture of ours that neither transformers nor PEFT knows, so its checkpoint (a torch state dict) is its only
format, and an export of it is refused with that reason rather than written in a form nothing else reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinker_atropos.config import TinkerSection
from tinker_atropos.models import hf_export, hf_lm, smollm2
from tinker_atropos.tinker_api import base_models
from tinker_atropos.tinker_api.wire import WireError
from tinker_atropos.training.data import ClientError
from tinker_atropos.training.served import LANGUAGE_MODELS, LanguageModel, ServedModel

FORMATS = ("peft", "merged")
CPU = torch.device("cpu")  # where an export rebuilds the model


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


@dataclass(frozen=True)
class Held:
    """What a checkpoint holds of a model, whichever driver wrote it: the base model's name, the LoRA settings it
    was built with (rank 0 or none: trained fully) and the network's state (a LoRA model's: its adapters)."""

    base_model: str
    lora: dict[str, Any]
    model: dict[str, torch.Tensor]


def held(state: object) -> Held:
    """The model of a Tinker checkpoint (``{"record": {"base_model", "lora"}, "model", ...}``, ``served.checkpoint``)
    or of an Atropos loop's (``{"core": {"spec": {"model", "lora"}, "model", ...}, "base_model", ...}``,
    ``AtroposLoop.save``), as ``torch.load`` reads it; WireError for anything else."""
    if isinstance(state, dict) and isinstance(state.get("record"), dict) and "model" in state:
        record = state["record"]
        return Held(str(record.get("base_model")), record.get("lora") or {}, state["model"])
    core = state.get("core") if isinstance(state, dict) else None
    if isinstance(core, dict) and isinstance(core.get("spec"), dict) and "model" in core:
        spec = core["spec"]
        return Held(str(state.get("base_model", spec.get("model"))), spec.get("lora") or {}, core["model"])
    raise WireError("neither a Tinker checkpoint nor an Atropos loop's (no record of its base model)")


def from_checkpoint(state: object, tinker: TinkerSection, config: str) -> LanguageModel:
    """The language model a checkpoint of the Tinker API or of the Atropos loop holds (``held``), rebuilt on the
    CPU over the base that was served: a built-in one, or the folder ``trainer.tinker.base_models`` of the run's
    config (read from ``config``, named in the refusal) gives its name, registered here first. WireError for a
    checkpoint of anything else or that does not fit its record; FatalError for a folder that cannot be served."""
    found = held(state)
    name = found.base_model
    if name in tinker.base_models:
        base_models.register(tinker.model_copy(update={"base_models": {name: tinker.base_models[name]}}), CPU)
    elif name.split("/")[0] in base_models.POLICY_KINDS:
        raise WireError(
            f"the checkpoint holds a {name}, not a language model: export control policies "
            "with --format onnx or pt2 (runs of `up`)"
        )
    elif name not in LANGUAGE_MODELS:
        raise WireError(
            f"the checkpoint holds a model of {name!r}, which is neither built in nor named by "
            f"trainer.tinker.base_models of {config}: give the config of the run that trained it with --config"
        )
    elif name == smollm2.NAME and not smollm2.available():
        raise WireError(f"{name} is not installed here (see docs/tinker.md, The Tinker API: Models)")
    try:
        model = LanguageModel(name, found.lora, CPU)
        model.load_model_state(found.model)
    except hf_lm.FolderError as error:  # its weights unreadable since the start check
        raise WireError(f"trainer.tinker.base_models[{name!r}]: {error}") from None
    except ClientError as error:  # a LoRA record without targets, a state missing its adapters
        raise WireError(str(error)) from None
    except RuntimeError as error:  # torch's size mismatches, a line each: the first says enough
        first = str(error).strip().splitlines()[-1].strip()
        raise WireError(f"the checkpoint does not fit its record ({found.lora}): {first}") from None
    return model
