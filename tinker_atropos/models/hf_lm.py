"""Any local causal LM a user serves: a Hugging Face model folder (``config.json``, safetensors weights, tokenizer
files) that transformers' ``AutoModelForCausalLM`` loads as a decoder-only stack whose layers have the projections
LoRA adapts (Llama, Qwen2/Qwen3, Mistral, Gemma and the others built like them), named in
``trainer.tinker.base_models``. Nothing is downloaded: the hub is off, the folder is read as it is.

``check`` reads what a start can afford (the config, the model's skeleton built without weights, the tokenizer as
sampling loads it and its chat template rendered, the weights' headers) and says in one line, naming the folder,
the file and the reason, why it cannot be served; ``load`` reads the weights, frozen: the base every model of it
shares. The model speaks the tiny LM's token-level functions through ``smollm2.SmolLM2``'s wrapper (a module
``hf`` inside it: LoRA goes in its decoder layers as in SmolLM2's).

transformers is always called with ``trust_remote_code=False``: a folder that needs code of its own (``auto_map``)
is refused, its code never run, and no process ever asks "Do you wish to run the custom code?" on its stdin."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
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
# the other files transformers reads a tokenizer from, where present
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")
CHAT_TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer_config.json",
)  # the first present
# the Linear layers LoRA adapts in each decoder layer (the names Llama, Qwen, Mistral and Gemma share), by the module
# holding them: Tinker's LoraConfig trains the attention's (train_attn) and the MLP's (train_mlp). The attention's
# are required; a mixture of experts (Mixtral, Qwen3-MoE) has no MLP projections of its own, and its LoRA adapts
# the attention and the unembedding
PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLIP = 300  # characters of transformers' reason in a start error
T = TypeVar("T")


class FolderError(ValueError):
    """A model folder that cannot be served; one line naming the folder and the reason."""


@dataclass(frozen=True)
class Folder:
    path: Path
    architecture: str  # the class transformers builds it as
    context: int  # tokens: the config's max_position_embeddings
    parameters: int  # counted from the weights' headers


def _fail(path: Path, reason: str) -> FolderError:
    return FolderError(f"model folder {path}: {reason}")


def _clip(text: str) -> str:
    """``text`` on one line, cut at a word's end with an ellipsis past ``CLIP`` characters (a first word longer
    than that kept whole): a start error stays readable and never ends mid-word."""
    words = text.split()
    line = " ".join(words)
    if len(line) <= CLIP:
        return line
    cut = line.rfind(" ", 0, CLIP + 1)
    return (line[:cut] if cut > 0 else words[0]) + " …"


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


def _not_json(path: Path, files: Sequence[str]) -> str | None:
    """Which of the ``.json`` files among ``files`` does not parse, and why: transformers' own reason ("Expecting
    value: line 1 column 1") names no file."""
    for name in files:
        if name.endswith(".json") and (path / name).is_file():
            try:
                json.loads((path / name).read_bytes())
            except ValueError as error:
                return f"{name} is not JSON ({error})"
    return None


def _read(path: Path, what: str, files: Sequence[str], read: Callable[[], T]) -> T:
    """``read()``, transformers reading ``files`` of the folder (with ``trust_remote_code=False``); FolderError,
    one line naming the files, when it fails: plainly a refusal when the folder needs code of its own, the file
    that is not JSON, else transformers' reason."""
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
        reason = _not_json(path, files) or f"{type(error).__name__}: {error}"
        raise _fail(path, f"cannot {what} ({', '.join(files)}): {_clip(reason)}") from None


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


def _not_causal(config: Any) -> str | None:
    """Why the config says the folder holds no causal LM: an encoder-decoder, or weights saved as another kind of
    model (``architectures``: a masked LM, an encoder, a classifier)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return f"a {config.model_type!r} model is an encoder-decoder, not a causal LM"
    named = getattr(config, "architectures", None) or []
    if named and not set(named) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return f'its "architectures" are {", ".join(named)}, not a causal LM'
    return None


def _unservable(model: nn.Module) -> str | None:
    """What sampling and LoRA need that ``model`` (transformers' causal LM of the folder's config) lacks: a stack of
    decoder layers at ``model.layers`` whose self-attention is causal (an encoder's, or a decoder's configured
    bidirectional, is not: ``is_causal``), with the projections LoRA adapts, and an unembedding at ``lm_head``."""
    kind = type(model).__name__
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not layers:
        return f"transformers builds it as {kind}, which has no decoder layers at model.layers: not a decoder-only LM"
    if any(getattr(getattr(layer, "self_attn", None), "is_causal", True) is False for layer in layers):
        return f"the self-attention of its {kind} is not causal (is_causal is false): not a causal LM"
    missing = {
        f"self_attn.{name}"
        for layer in layers
        for name in PROJECTIONS["self_attn"]
        if not _linear(layer, "self_attn", name)
    }
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        missing.add("lm_head")
    if missing:
        wanted = [f"self_attn.{name}" for name in PROJECTIONS["self_attn"]] + ["lm_head"]
        return (
            f"the decoder layers of its {kind} lack {', '.join(n for n in wanted if n in missing)}: the Linear "
            "layers LoRA adapts"
        )
    return None


def check(path: str | Path) -> Folder:
    """What a start checks of a folder; FolderError (one line, the folder named) when it cannot be served. No
    weights are read: the model is built on the meta device, which takes no memory whatever its size."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise _fail(path, "no such folder" if not path.exists() else "not a folder")
    smollm2.offline()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _read(
        path,
        "read its config",
        ("config.json",),
        lambda: AutoConfig.from_pretrained(path, trust_remote_code=False),
    )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _fail(
            path, f"config.json: a {config.model_type!r} model, which transformers cannot load as a causal LM"
        )
    if reason := _not_causal(config):
        raise _fail(path, f"config.json: {reason}")
    with torch.device("meta"):
        skeleton = _read(
            path,
            "build its model",
            ("config.json",),
            lambda: AutoModelForCausalLM.from_config(config, trust_remote_code=False),
        )
    if reason := _unservable(skeleton):
        raise _fail(path, f"config.json: {reason}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise _fail(path, f"no tokenizer in it (one of {', '.join(TOKENIZER_FILES)})")
    _chat(path, tokenizer(path))
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return Folder(path, type(skeleton).__name__, context, _parameters(path))


def _chat(path: Path, loaded: Any) -> None:  # a transformers tokenizer
    """A one-message chat rendered with the tokenizer's chat template, where it has one: what a client of a chat
    model (an atroposlib environment, a Cookbook renderer) does first with it."""
    if not loaded.chat_template:
        return
    template = next(
        (name for name in CHAT_TEMPLATE_FILES if (path / name).is_file()), "tokenizer_config.json"
    )
    _read(
        path,
        "render a one-message chat with its chat template",
        (template,),
        lambda: loaded.apply_chat_template(
            [{"role": "user", "content": "Hello"}], add_generation_prompt=True
        ),
    )


def load(path: str | Path, dtype: torch.dtype) -> smollm2.SmolLM2:
    """The folder's model, frozen, in eval mode, its weights as ``dtype``; FolderError when they cannot be read."""
    folder = check(path)
    from transformers import AutoModelForCausalLM

    model = _read(
        folder.path,
        "load its weights",
        [file.name for file in sorted(folder.path.glob("*.safetensors"))],
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
    files = [name for name in (*TOKENIZER_FILES, *TOKENIZER_EXTRAS) if (path / name).is_file()]
    return _read(
        path,
        "read its tokenizer",
        files,
        lambda: AutoTokenizer.from_pretrained(path, trust_remote_code=False),
    )


def _linear(layer: nn.Module, part: str, name: str) -> bool:
    return isinstance(getattr(getattr(layer, part, None), name, None), nn.Linear)


def lora_targets(model: smollm2.SmolLM2, attn: bool, mlp: bool, unembed: bool) -> list[tuple[nn.Module, str]]:
    """The Linear layers LoRA adapts, as Tinker's ``LoraConfig`` selects them: ``PROJECTIONS`` of every decoder
    layer (``check`` refused a folder lacking the attention's; a mixture of experts has no MLP ones) and the
    unembedding."""
    chosen = {"self_attn": attn, "mlp": mlp}
    targets = [
        (getattr(layer, part), name)
        for layer in model.hf.model.layers
        for part, names in PROJECTIONS.items()
        if chosen[part]
        for name in names
        if _linear(layer, part, name)
    ]
    if unembed:
        targets.append((model.hf, "lm_head"))
    return targets
