"""Any local causal LM a user serves: a Hugging Face model folder (``config.json``, safetensors weights, tokenizer
files) that transformers' ``AutoModelForCausalLM`` loads (Llama, Qwen2/Qwen3, Mistral, Gemma and the others it
knows), named in ``trainer.tinker.base_models``. Nothing is downloaded: the hub is off, the folder is read as it is.

``check`` reads what a start can afford (the config, the tokenizer's presence, the weights' headers) and says in
one line, naming the folder, why it cannot be served; ``load`` reads the weights, frozen: the base every model of
it shares. The model speaks the tiny LM's token-level functions through ``smollm2.SmolLM2``'s wrapper (a module
``hf`` inside it: LoRA goes in its decoder layers as in SmolLM2's).

transformers is always called with ``trust_remote_code=False``: a folder that needs code of its own (``auto_map``)
is refused, its code never run, and no process ever asks "Do you wish to run the custom code?" on its stdin."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tinker_atropos.models import smollm2

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
)  # one of them: a tokenizer transformers reads
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
T = TypeVar("T")


class FolderError(ValueError):
    """A model folder that cannot be served; one line naming the folder and the reason."""


@dataclass(frozen=True)
class Folder:
    path: Path
    architecture: str
    context: int  # tokens: the config's max_position_embeddings
    parameters: int  # counted from the weights' headers


def _fail(path: Path, reason: str) -> FolderError:
    return FolderError(f"model folder {path}: {reason}")


def _own_code(path: Path) -> list[str]:
    """The code of its own a folder names (``auto_map`` of its config.json or tokenizer_config.json)."""
    named = []
    for file in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((path / file).read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object
            continue
        for refs in auto_map.values() if isinstance(auto_map, dict) else []:
            named += [str(ref) for ref in (refs if isinstance(refs, list) else [refs]) if ref]
    return named


def _read(path: Path, what: str, read: Callable[[], T]) -> T:
    """``read()``, transformers reading the folder (with ``trust_remote_code=False``); FolderError, one line, when
    it fails: plainly a refusal when the folder needs code of its own, else transformers' reason."""
    try:
        return read()
    except Exception as error:  # missing, unreadable, an unknown model type, code of its own
        own = _own_code(path)
        if own:
            raise _fail(
                path,
                f"cannot {what}: it needs code of its own ({', '.join(own)}, named by its auto_map), "
                "which this server never runs; serve a model type transformers knows",
            ) from None
        raise _fail(path, f"cannot {what} ({' '.join(str(error).split())[:300]})") from None


def _parameters(path: Path) -> int:
    """The weights' element count, from the safetensors headers alone (8 bytes of length, then JSON)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _fail(path, "no *.safetensors weights in it")
    count = 0
    for file in files:
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as error:
            raise _fail(path, f"cannot read {file.name}: {error}") from None
        for name, entry in header.items():
            if name != "__metadata__":
                shape = entry.get("shape", [])
                count += int(torch.Size(shape).numel())
    return count


def check(path: str | Path) -> Folder:
    """What a start checks of a folder; FolderError (one line, the folder named) when it cannot be served."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise _fail(path, "no such folder" if not path.exists() else "not a folder")
    smollm2.offline()
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _read(
        path, "read its config.json", lambda: AutoConfig.from_pretrained(path, trust_remote_code=False)
    )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _fail(path, f"a {config.model_type!r} model, which transformers cannot load as a causal LM")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise _fail(path, f"no tokenizer in it (one of {', '.join(TOKENIZER_FILES)})")
    architecture = (
        getattr(config, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    )[0]
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return Folder(path, architecture, context, _parameters(path))


def load(path: str | Path, dtype: torch.dtype) -> smollm2.SmolLM2:
    """The folder's model, frozen, in eval mode, its weights as ``dtype``; FolderError when they cannot be read."""
    folder = check(path)
    from transformers import AutoModelForCausalLM

    model = _read(
        folder.path,
        "load its weights",
        lambda: AutoModelForCausalLM.from_pretrained(folder.path, dtype=dtype, trust_remote_code=False),
    )
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    wrapped = smollm2.SmolLM2(model.eval(), int(eos if eos is not None else -1), max_seq_len=folder.context)
    return wrapped.requires_grad_(False)


def tokenizer(path: str | Path) -> Any:  # a transformers tokenizer
    smollm2.offline()
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    return _read(
        path, "read its tokenizer", lambda: AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    )


def lora_targets(model: smollm2.SmolLM2, attn: bool, mlp: bool, unembed: bool) -> list[tuple[nn.Module, str]]:
    """The Linear layers LoRA adapts, as Tinker's ``LoraConfig`` selects them: the attention's and the MLP's
    projections of every decoder layer (the names Llama, Qwen, Mistral and Gemma share), and the unembedding."""
    targets: list[tuple[nn.Module, str]] = []
    for layer in model.hf.model.layers:
        for parent, names, chosen in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj"), attn),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj"), mlp),
        ):
            if chosen:
                targets += [(parent, n) for n in names if isinstance(getattr(parent, n, None), nn.Linear)]
    if unembed:
        targets.append((model.hf, "lm_head"))
    return targets
