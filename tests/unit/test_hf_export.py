"""A transformers LM with our LoRA, out of the run (``models/hf_export.py``, ``tinker_api/engine/weights_out.py``):
the PEFT adapter folder and the merged Hugging Face folder load with transformers and PEFT alone and give the
logits our wrapped model gives; what cannot leave that way is refused in one line. A small random Llama with a
tied unembedding (as SmolLM2's) stands in for SmolLM2 here; tests/services/test_tinker_weights_out.py takes
SmolLM2 itself through the SDK and the CLI."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tinker_atropos.config import TinkerSection
from tinker_atropos.models import hf_export, lora
from tinker_atropos.tinker_api.engine import weights_out
from tinker_atropos.tinker_api.wire import WireError
from tinker_atropos.training.served import TINY_LM, LanguageModel, checkpoint

TOLERANCE = 1e-4  # float32: folding B A into W reorders the sums


def read(state: dict) -> LanguageModel:
    """A checkpoint's model as ``export`` rebuilds it, for a run whose config serves no model folder."""
    return weights_out.from_checkpoint(state, TinkerSection(), "run/config.yaml")


def llama(folder: Path) -> LlamaForCausalLM:
    """A small random Llama, saved to ``folder`` as a base, with its unembedding tied to its embeddings."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def adapted(model: LlamaForCausalLM, rank: int = 4, unembed: bool = True) -> LlamaForCausalLM:
    """``model`` with our LoRA on every Linear SmolLM2's targets name, B away from zero as after training."""
    targets: list[tuple[torch.nn.Module, str]] = []
    for layer in model.model.layers:
        targets += [(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        targets += [(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    if unembed:
        targets.append((model, "lm_head"))
    lora.wrap(model, targets, rank, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in lora.adapter(model).values():
            layer.lora_b.normal_(0.0, 0.05, generator=generator)
    return model


TOKENS = torch.tensor([[1, 5, 9, 33, 71, 2, 64, 15, 90, 3]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("unembed", [True, False])
def test_the_peft_adapter_and_the_merged_folder_give_our_logits(tmp_path: Path, unembed: bool) -> None:
    model = adapted(llama(tmp_path / "base"), unembed=unembed)
    ours = logits(model)
    assert (
        ours - logits(AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    ).abs().max() > 1e-2  # trained

    written = hf_export.write_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    assert {path.name for path in written} == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 32.0)  # Tinker's alpha, 32
    keys = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert keys["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)  # [out, r]
    with (
        pytest.warns(UserWarning, match="tie_word_embeddings") if unembed else contextlib.nullcontext()
    ):  # PEFT's note on a tied head's adapter
        peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
    assert (logits(peft.eval()) - ours).abs().max() == 0.0  # the same operations: the same numbers

    written += hf_export.write_merged(model, tmp_path / "merged", tmp_path / "base")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (logits(merged) - ours).abs().max() < TOLERANCE
    # every file as open() makes one (0644 under a umask of 022), the weights too (safetensors writes 0600)
    mask = os.umask(0o022)
    os.umask(mask)
    assert {path.name: path.stat().st_mode & 0o777 for path in written} == dict.fromkeys(
        [path.name for path in written], 0o666 & ~mask
    )
    # the tied head's adapter went into a head of its own; the input embeddings are the base's
    assert merged.config.tie_word_embeddings is not unembed
    assert torch.equal(merged.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_model_trained_fully_is_merged_as_it_is_and_has_no_adapter(tmp_path: Path) -> None:
    model = llama(tmp_path / "base")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        hf_export.write_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    hf_export.write_merged(model, tmp_path / "merged", tmp_path / "base")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(logits(merged), logits(model))


def test_the_tiny_lm_and_a_bad_checkpoint_are_refused_in_one_line(tmp_path: Path) -> None:
    tiny = LanguageModel(TINY_LM, {"rank": 2}, torch.device("cpu"))
    for fmt in weights_out.FORMATS:
        with pytest.raises(
            WireError, match="an architecture of ours, which neither transformers nor PEFT loads"
        ):
            weights_out.write(tiny, fmt, tmp_path / fmt)
    with pytest.raises(WireError, match="'safetensors' is not one of: peft, merged"):
        weights_out.write(tiny, "safetensors", tmp_path / "x")
    assert not any(tmp_path.iterdir())  # nothing half-written

    state = checkpoint(tiny, {"base_model": TINY_LM, "lora": {"rank": 2}})
    assert read(state).lora  # a tiny LM's checkpoint reads back...
    with pytest.raises(WireError, match="neither a Tinker checkpoint nor an Atropos loop's"):
        read({"version": 3})
    with pytest.raises(WireError, match="not a language model"):
        read({**state, "record": {"base_model": "mlp-gaussian/Pendulum-v1"}})
    with pytest.raises(WireError, match="does not fit"):  # ...and one of another rank does not fit
        read({**state, "record": {"base_model": TINY_LM, "lora": {"rank": 3}}})
    # a model folder's name that the run's config does not hold: the line says where it looked
    with pytest.raises(
        WireError, match=r"'local/qwen3', which is neither built in nor named by trainer\.tinker\."
    ):
        read({**state, "record": {"base_model": "local/qwen3", "lora": {"rank": 2}}})


def test_an_atropos_loops_checkpoint_reads_back_as_the_model_it_trained() -> None:
    """The Atropos loop's layout (``AtroposLoop.save``): the core's state and the base model's name."""
    trained = LanguageModel(TINY_LM, {"rank": 2}, torch.device("cpu"))
    with torch.no_grad():
        for layer in trained.adapter.values():
            layer.lora_b.normal_(0.0, 0.05)
    state = {"core": trained.core.state_dict(), "step": 3, "counters": {}, "base_model": TINY_LM}
    back = read(state)
    assert back.lora and back.base_model == TINY_LM
    assert all(
        torch.equal(back.adapter[name].lora_b, layer.lora_b) for name, layer in trained.adapter.items()
    )
