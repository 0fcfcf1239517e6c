"""Any local causal LM by config. Small random models of
five transformers families, saved here as Hugging Face folders (``tests/support/hf_models.py``), are served by a
real trainer through ``trainer.tinker.base_models``: listed with their context, trained with LoRA and fully
through the official SDK, sampled with a string stop; one adapter's step changes no other model of its base; the
LoRA models past ``max_adapters_per_base`` are refused with the setting named, the others unwedged. A folder that
cannot be served fails the start with one line naming it. A LoRA model of a folder leaves the run through
``tinker-atropos export`` as a PEFT adapter over that folder and as a merged folder, both giving the server's
log-probabilities in transformers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import yaml
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from tests.support.hf_models import FAMILIES, custom_code_folder, model_folder, transformers_logprobs
from tests.support.processes import Processes
from tests.support.running import cli
from tests.support.tinker_server import KEY, TinkerTrainer, sdk_session, serving
from tinker_atropos.errors import EXIT_FATAL
from tinker_atropos.models import tiny_lm
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

TOK = tiny_lm.ByteTokenizer()
ADAM = types.AdamParams(learning_rate=1e-2)
SMALL_STEP = types.AdamParams(learning_rate=1e-3)
TOLERANCE = 1e-4  # float32 log-probabilities; folding B A into W reorders the sums


def datum(text: str) -> types.Datum:
    tokens = TOK.encode(text, add_bos=True)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64)},
    )


@pytest.fixture(scope="module")
def trainer(valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerTrainer]:
    folders = tmp_path_factory.mktemp("hf-models")
    served = {f"local/{family}": str(model_folder(folders / family, family)) for family in FAMILIES}
    with serving(
        tmp_path_factory.mktemp("tk-bases"),
        valkey.url,
        "tk-bases",
        base_models=served,
        max_adapters_per_base=2,
        long_poll_s=0.5,
    ) as started:
        yield started


def test_every_family_is_listed_trained_with_lora_and_fully_and_sampled_with_a_stop_string(
    trainer: TinkerTrainer,
) -> None:
    rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
    listed = {
        m.model_name: m.max_context_length
        for m in rest.get_server_capabilities().result(timeout=30).supported_models
    }
    assert all(listed[f"local/{family}"] == 256 for family in FAMILIES), listed
    with sdk_session(trainer) as service:
        for family, rank in [*((f, 4) for f in FAMILIES), ("llama", 0)]:
            client = service.create_lora_training_client(base_model=f"local/{family}", rank=rank).result(
                timeout=60
            )
            losses = []
            for _ in range(3):
                backward = client.forward_backward([datum("abcabcabc")], "cross_entropy")
                client.optim_step(ADAM).result(timeout=60)
                losses.append(backward.result(timeout=60).metrics["loss:sum"])
            assert losses[-1] < losses[0], (family, rank, losses)
            sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
            params = types.SamplingParams(max_tokens=12, seed=3, stop=["a"], temperature=1.0)
            prompt = types.ModelInput.from_ints(TOK.encode("abc", add_bos=True))
            drawn = sampler.sample(prompt, 2, params).result(timeout=60).sequences
            assert len(drawn) == 2 and all(s.tokens for s in drawn), (family, drawn)
            for s in drawn:  # stopped at the string, or ran out of tokens without it
                assert ("a" in TOK.decode(s.tokens)) == (s.stop_reason == "stop"), (family, s)


def test_one_adapters_step_leaves_the_other_models_of_its_base_and_past_the_limit_is_refused(
    trainer: TinkerTrainer,
) -> None:
    with sdk_session(trainer) as service:
        trained, other = (
            service.create_lora_training_client(base_model="local/qwen2", rank=4).result(timeout=60)
            for _ in range(2)
        )
        other.forward_backward([datum("xyzxyz")], "cross_entropy").result(timeout=60)
        other.optim_step(ADAM).result(timeout=60)
        probe = datum("hello there")
        before = (
            other.forward([probe], "cross_entropy")
            .result(timeout=60)
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        trained_before = trained.forward([probe], "cross_entropy").result(timeout=60).metrics["loss:sum"]
        for _ in range(2):  # small steps: at 1e-2 two of them could overshoot from some random inits of A
            trained.forward_backward([probe], "cross_entropy").result(timeout=60)
            trained.optim_step(SMALL_STEP).result(timeout=60)
        after = (
            other.forward([probe], "cross_entropy")
            .result(timeout=60)
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        np.testing.assert_array_equal(after, before)
        trained_after = trained.forward([probe], "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert trained_after < trained_before
        with pytest.raises(Exception, match="max_adapters_per_base"):
            service.create_lora_training_client(base_model="local/qwen2", rank=4).result(timeout=60)
        full = service.create_lora_training_client(base_model="local/qwen2", rank=0).result(
            timeout=60
        )  # not one
        full.forward_backward([probe], "cross_entropy").result(timeout=60)
        other.forward_backward([probe], "cross_entropy").result(timeout=60)  # the refusal wedged nothing
        other.optim_step(ADAM).result(timeout=60)


def test_a_lora_model_of_a_folder_leaves_the_run_as_an_adapter_and_merged_with_the_servers_logprobs(
    trainer: TinkerTrainer, tmp_path: Path
) -> None:
    tokens = TOK.encode("a folder's model, out of the run", add_bos=True)
    probe = datum("a folder's model, out of the run")
    with sdk_session(trainer) as service:
        client = service.create_lora_training_client(base_model="local/qwen3", rank=4, seed=0).result(
            timeout=60
        )
        for _ in range(2):  # B away from zero: an adapter that changes the logits
            client.forward_backward([probe], "cross_entropy")
            client.optim_step(ADAM).result(timeout=60)
        served = client.forward([probe], "cross_entropy").result(timeout=60)
        server = served.loss_fn_outputs[0]["logprobs"].to_numpy()
        checkpoint = client.save_state("trained").result(timeout=60).path
    saved = trainer.run_dir / "tinker" / client.model_id.replace(":", "_") / "weights" / "trained.pt"
    # a trainer started alone has no config.yaml in its run folder: the config that served the folder is named;
    # the adapter from the tinker:// path, the merged folder from the run folder's newest checkpoint (this one)
    for fmt, chosen in (("peft", ["--checkpoint", checkpoint]), ("merged", [])):
        options = ["--config", str(trainer.config), "--format", fmt, "--out", str(tmp_path / fmt), *chosen]
        made = cli("export", str(trainer.run_dir), *options)
        assert made.returncode == 0, made.stderr[-3000:]
        assert f" of local/qwen3 from {saved} " in made.stdout, made.stdout

    folder = yaml.safe_load(trainer.config.read_text())["trainer"]["tinker"]["base_models"]["local/qwen3"]
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(Path(folder).resolve())  # the folder that was served
    base = AutoModelForCausalLM.from_pretrained(folder)
    assert np.abs(transformers_logprobs(base, tokens[:-1], tokens[1:]) - server).max() > 10 * TOLERANCE
    peft = PeftModel.from_pretrained(base, tmp_path / "peft")
    assert np.abs(transformers_logprobs(peft, tokens[:-1], tokens[1:]) - server).max() < TOLERANCE
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert np.abs(transformers_logprobs(merged, tokens[:-1], tokens[1:]) - server).max() < TOLERANCE


def test_a_folder_that_cannot_be_served_fails_the_start_with_one_line_naming_it(
    valkey: EmbeddedValkey, tmp_path: Path
) -> None:
    """A folder whose ``auto_map`` names code of its own is refused, that code never run, even
    with "y" on the trainer's stdin (transformers' prompt once ran it), and the line does not advise trusting it."""
    bad = tmp_path / "bad"
    (bad / "config.json").parent.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "t5"}))
    marker = tmp_path / "custom-code-ran"
    custom = custom_code_folder(tmp_path / "custom", marker)
    (answers := tmp_path / "yes").write_text("y\n" * 10)
    for folder, reason in (
        (tmp_path / "missing", "no such folder"),
        (bad, "cannot load as a causal LM"),
        (custom, "needs code of its own"),
    ):
        (logs := tmp_path / f"logs-{folder.name}").mkdir()
        processes = Processes(logs)
        server = TinkerTrainer(processes, tmp_path, valkey.url, "tk-bad", base_models={"mine": str(folder)})
        with answers.open("rb") as stdin:
            process = processes.start(
                "trainer",
                "--config",
                str(server.config),
                "--redis-url",
                valkey.url,
                "--port",
                str(server.grpc_port),
                "--run-dir",
                str(tmp_path / "run"),
                name="t",
                stdin=stdin,
            )
        try:
            assert process.wait(timeout=60) == EXIT_FATAL, processes.log("t")
        finally:
            processes.stop_all()
        lines = [line for line in processes.log("t").splitlines() if str(folder) in line]
        assert len(lines) == 1 and reason in lines[0] and "base_models['mine']" in lines[0], processes.log(
            "t"
        )
        assert "trust_remote_code" not in processes.log("t") and not marker.exists(), processes.log("t")
