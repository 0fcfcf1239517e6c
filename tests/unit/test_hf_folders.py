"""The start check of a model folder (``hf_lm.check``): what sampling and training cannot use (no decoder-only causal
LM, no projections for LoRA, a tokenizer or chat template that does not load) is refused in one whole line naming
the folder, the file and the reason, before any weights are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.hf_models import bert_folder, model_folder
from tinker_atropos.models import hf_lm


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("llama"), "llama")


def refusal(folder: Path, *named: str) -> str:
    """The one line ``check`` refuses ``folder`` with, which names it and each of ``named``."""
    with pytest.raises(hf_lm.FolderError) as caught:
        hf_lm.check(folder)
    line = str(caught.value)
    assert "\n" not in line and str(folder) in line and all(name in line for name in named), line
    return line


def copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


@pytest.mark.parametrize(
    "head, reason",
    [
        ("BertForMaskedLM", 'its "architectures" are BertForMaskedLM, not a causal LM'),
        ("BertLMHeadModel", "BertLMHeadModel, which has no decoder layers at model.layers"),
    ],
)
def test_a_bert_folder_is_refused_as_no_decoder_only_causal_lm(
    tmp_path: Path, head: str, reason: str
) -> None:
    assert reason in refusal(bert_folder(tmp_path / "bert", head), "config.json")


def test_a_decoder_configured_with_bidirectional_attention_is_refused(tmp_path: Path) -> None:
    gemma = model_folder(tmp_path / "gemma", "gemma")
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps(config | {"use_bidirectional_attention": True}))
    assert "self-attention of its GemmaForCausalLM is not causal" in refusal(gemma, "config.json")


def test_a_family_without_the_projections_lora_adapts_is_refused_naming_them(tmp_path: Path) -> None:
    line = refusal(model_folder(tmp_path / "phi3", "phi3"), "config.json")  # fused qkv_proj and gate_up_proj
    assert "lack self_attn.q_proj, self_attn.k_proj, self_attn.v_proj: the Linear layers" in line


def test_a_tokenizer_that_does_not_load_is_refused_naming_its_file(llama: Path, tmp_path: Path) -> None:
    folder = copy(llama, tmp_path / "folder")
    (folder / "tokenizer.json").write_text("<html>not found</html>")
    assert "cannot read its tokenizer" in refusal(folder, "tokenizer.json is not JSON (Expecting value")


def test_a_chat_template_that_does_not_render_is_refused_naming_its_file(llama: Path, tmp_path: Path) -> None:
    folder = copy(llama, tmp_path / "folder")
    (folder / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    refusal(folder, "cannot render a one-message chat with its chat template (chat_template.jinja)")


def test_a_long_reason_is_cut_at_a_word_end(tmp_path: Path) -> None:
    """transformers' reason for an unknown model type runs on for lines: cut with an ellipsis after a whole word."""
    (folder := tmp_path / "folder").mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    line = refusal(folder, "cannot read its config (config.json)")
    from transformers import AutoConfig

    with pytest.raises(ValueError) as caught:
        AutoConfig.from_pretrained(folder)
    words = str(caught.value).split()
    assert line.endswith(" …") and line.removesuffix(" …").split()[-1] in words, line
