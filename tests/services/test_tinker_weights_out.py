"""Weights out of the run: SmolLM2 trained with LoRA through the unmodified SDK leaves as a PEFT adapter
(``save_weights_external``) and as a merged Hugging Face folder (``tinker-atropos export`` on its checkpoint), and
both, loaded with transformers and PEFT alone, give the log-probabilities the server computes; the tiny LM and a
wrong checkpoint are refused in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from tests.support.hf_models import transformers_logprobs
from tests.support.running import cli, cli_here
from tests.support.tinker_server import KEY, TinkerTrainer, sdk_session, serving
from tinker_atropos.models import smollm2
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4  # float32 log-probabilities; folding B A into W reorders the sums


@pytest.fixture(scope="module")
def trainer(valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerTrainer]:
    with serving(tmp_path_factory.mktemp("tk-out"), valkey.url, "tk-out", long_poll_s=0.5) as server:
        yield server


def test_smollm2_lora_leaves_as_a_peft_adapter_and_merged_with_the_servers_logprobs(
    trainer: TinkerTrainer, tmp_path: Path
) -> None:
    tokenizer = smollm2.tokenizer()
    text = tokenizer.encode("Weights leave tinker-atropos in the formats everyone loads.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(text[:-1]), loss_fn_inputs={"target_tokens": text[1:]}
    )
    with sdk_session(trainer) as service:
        client = service.create_lora_training_client(base_model=smollm2.NAME, rank=4, seed=0).result(
            timeout=300
        )
        for _ in range(2):  # B away from zero: an adapter that changes the logits
            client.forward_backward([datum], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        served = client.forward([datum], "cross_entropy").result(timeout=120)
        server = served.loss_fn_outputs[0]["logprobs"].to_numpy()
        checkpoint = client.save_state("trained").result(timeout=120).path
        external = client.save_weights_external("adapter").result(timeout=120).path
        assert external == f"tinker://{client.model_id}/external_weights/adapter"
        with pytest.raises(tinker.RequestFailedError, match="exist"):
            client.save_weights_external("adapter").result(timeout=120)
        rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
        listed = rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
        assert {c.checkpoint_type for c in listed} == {"training", "external"}
        tiny = service.create_lora_training_client(base_model="tiny-byte-lm", rank=2).result(timeout=60)
        with pytest.raises(tinker.RequestFailedError, match="neither transformers nor PEFT"):
            tiny.save_weights_external("tiny").result(timeout=60)

    adapter = trainer.run_dir / "tinker" / client.model_id.replace(":", "_") / "external_weights" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 32.0)
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    unadapted = transformers_logprobs(base, text[:-1], text[1:])
    assert np.abs(unadapted - server).max() > 0.1  # the adapter moved the model: the checks below can fail
    peft = PeftModel.from_pretrained(base, adapter)
    assert np.abs(transformers_logprobs(peft, text[:-1], text[1:]) - server).max() < TOLERANCE
    tinker.RestClient(base_url=trainer.url, api_key=KEY).delete_checkpoint_from_tinker_path(external).result(
        30
    )
    assert not adapter.exists()  # deleted as any checkpoint is, its folder too

    made = cli(
        "export",
        str(trainer.run_dir),
        "--format",
        "merged",
        "--checkpoint",
        checkpoint,
        "--out",
        str(tmp_path / "merged"),
    )
    assert made.returncode == 0, made.stderr
    assert "Hugging Face model folder of HuggingFaceTB/SmolLM2-135M-Instruct" in made.stdout
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert np.abs(transformers_logprobs(merged, text[:-1], text[1:]) - server).max() < TOLERANCE

    for argv, why in [
        (("--format", "peft", "--checkpoint", "tinker://nobody/weights/none"), "checkpoint tinker://nobody"),
        (("--format", "peft", "--checkpoint", checkpoint, "--out", str(tmp_path / "merged")), "not an empty"),
        (("--format", "gguf"), "'gguf' is not one of: onnx, pt2, peft, merged"),
    ]:
        refused = cli_here("export", str(trainer.run_dir), *argv)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
