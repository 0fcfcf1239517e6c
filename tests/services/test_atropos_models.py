"""The Atropos loop on a language model of a local Hugging Face folder (``trainer.atropos.base_model`` naming a
``trainer.tinker.base_models`` entry): atroposlib's own ``ManagedServer`` samples groups through the folder's
tokenizer from the trainer's inference endpoint, the loop learns from them with LoRA over the shared frozen base,
and every route answers in that tokenizer's ids, text and chat template. A random Llama of two layers with a
word-level tokenizer of its own (no byte of it shared with the tiny LM's) stands for any model: nothing is
downloaded."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
import redis
import torch
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.support.hf_models import model_folder
from tinker_atropos.config import SMOLLM2, TINY_LM, Config, ConfigError, parse_config
from tinker_atropos.errors import FatalError
from tinker_atropos.frontends.http import run_key
from tinker_atropos.launcher.client_files import tokenizer_folder
from tinker_atropos.models import smollm2, tiny_lm
from tinker_atropos.trainer.atropos_loop import AtroposLoop
from tinker_atropos.trainer.checkpointing import Checkpointer
from tinker_atropos.training import served

RUN_TOKEN = "the-run-token"
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the model's 258 ids (its specials, then words w6 .. w257) with a chat template of
    its own, written over the folder's byte tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), 258)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # words joined by spaces
    words.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = model_folder(tmp_path_factory.mktemp("models") / "llama", "llama")
    word_tokenizer(folder)
    return folder


def _config(folder: Path, run: str, **atropos: object) -> dict:
    return {
        "run": {"name": run},
        "trainer": {
            "experience_loop": False,
            "tinker": {"base_models": {"my-llama": str(folder)}},
            "atropos": {"enabled": True, "base_model": "my-llama", "inference_port": 0, **atropos},
        },
    }


def _loop(
    llama: Path,
    tmp_path: Path,
    client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    run: str,
    rank: int,
    learning_rate: float,
    batch_size: int,
) -> tuple[Config, AtroposLoop]:
    """The run's config and its Atropos loop on the Llama folder, with the run's token set."""
    monkeypatch.setenv("TA_TOKEN", RUN_TOKEN)
    config = parse_config(
        _config(llama, run, lora_rank=rank, learning_rate=learning_rate, batch_size=batch_size)
    )
    return config, AtroposLoop(config, client, tmp_path / "run", torch.device("cpu"))


def _adapters(loop: AtroposLoop) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loop.model.model_state().items()}


def test_the_loop_trains_a_model_folders_lm_with_lora_sampled_through_its_own_tokenizer(
    llama: Path, tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, loop = _loop(llama, tmp_path, redis_client, monkeypatch, "atropos-llama", 4, 3e-2, 8)
    hf = AutoTokenizer.from_pretrained(str(llama))
    # the environments get the folder itself as their tokenizer (atroposlib's tokenizer_name)
    assert tokenizer_folder(config, tmp_path) == str(llama.resolve())
    core = loop.model.core
    base = {name: p for name, p in core.model.named_parameters() if core.is_shared(p)}
    assert base and loop.model.lora
    served = dict(loop.sampler.model.named_parameters())
    assert all(served[name] is p for name, p in base.items())  # the sampler's copy holds the base, not a copy
    before, base_before = _adapters(loop), {k: v.clone() for k, v in base.items()}
    stop = threading.Event()
    loop.inference.start(stop)
    key = run_key("inference", RUN_TOKEN)
    try:
        server = SGLangServer(
            APIServerConfig(
                model_name="my-llama",
                base_url=f"{loop.inference.url}/v1",
                api_key=key,
                tokenizer_name=str(llama),
                timeout=30,
                health_check=False,
            )
        )

        async def group(prompt: str, target: int) -> dict:
            """A group as an environment makes it: 8 completions through the folder's tokenizer, each scored by
            how many of its tokens are ``target`` or below."""
            managed = ManagedServer(server, tokenizer=hf)
            await managed.completion(prompt=prompt, n=8, max_tokens=6, temperature=1.0)
            nodes = managed.get_state()["nodes"]
            scores = [float(sum(t <= target for t in n.masked_tokens if t != -100)) for n in nodes]
            return {
                "tokens": [n.tokens for n in nodes],
                "masks": [n.masked_tokens for n in nodes],
                "inference_logprobs": [n.logprobs for n in nodes],
                "scores": scores,
            }

        for step in range(1, 4):
            groups = [asyncio.run(group(prompt, 130)) for prompt in ("w7 w8 w9", "w10 w11")]
            assert groups[0]["tokens"][0][:3] == hf.encode("w7 w8 w9")  # the prompt in the folder's ids
            loop.learn(groups)
            assert loop.sampler.version == core.version == step, loop.counters
        counted = loop.counters  # a group whose 8 scores came out equal teaches nothing: skipped
        assert counted["sequences_trained"] + 8 * counted["groups_skipped_equal"] == 3 * 16
        assert counted["sequences_trained"] > 0 and counted["groups_invalid"] == 0
        # the adapters learned, the shared base did not move
        assert any(not torch.equal(before[k], v) for k, v in loop.model.model_state().items())
        assert all(torch.equal(base_before[k], v) for k, v in base.items())

        http = httpx.Client(
            base_url=loop.inference.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        messages = [{"role": "user", "content": "w20 w21 w22"}]
        chat = http.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "logprobs": True, "seed": 3}
        ).json()
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(hf.encode(rendered, add_special_tokens=False)) == 6
        ids = [hf.convert_tokens_to_ids(t["token"]) for t in chat["choices"][0]["logprobs"]["content"]]
        assert chat["choices"][0]["message"]["content"] == hf.decode(ids, skip_special_tokens=True)
        assert chat["policy_version"] == 3 and chat["model"] == "my-llama"
        generated = http.post(
            "/generate",
            json={"text": "w30 w31", "return_logprob": True, "sampling_params": {"max_new_tokens": 4}},
        ).json()
        assert generated["meta_info"]["prompt_tokens"] == 2 and all(
            0 <= t < 258 for t in generated["output_ids"]
        )
        assert generated["text"] == hf.decode(generated["output_ids"], skip_special_tokens=True)
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 256  # the folder's context
        too_long = http.post("/v1/completions", json={"prompt": " ".join(["w40"] * 300), "max_tokens": 1})
        assert too_long.status_code == 400 and "the context is 256" in too_long.text, too_long.text
    finally:
        stop.set()
        loop.close()

    # a checkpoint holds the adapters: a restarted loop serves what this one trained
    Checkpointer(loop, loop.folder, config.trainer.checkpoint, None).save(force=True)
    resumed = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"))
    Checkpointer(resumed, resumed.folder, config.trainer.checkpoint, None).resume()
    assert resumed.sampler.version == 3
    assert all(torch.equal(v, resumed.model.model_state()[k]) for k, v in loop.model.model_state().items())
    # another base model's loop refuses it in one line
    tiny = parse_config(
        {
            **_config(llama, "atropos-llama"),
            "trainer": {"experience_loop": False, "atropos": {"enabled": True, "inference_port": 0}},
        }
    )
    other = AtroposLoop(tiny, redis_client, tmp_path / "run", torch.device("cpu"))
    with pytest.raises(
        FatalError, match="holds a my-llama model, trainer.atropos.base_model is tiny-byte-lm"
    ):
        Checkpointer(other, other.folder, tiny.trainer.checkpoint, None).resume()


def test_full_fine_tuning_of_a_folders_lm_serves_every_changed_weight(
    llama: Path, tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, loop = _loop(llama, tmp_path, redis_client, monkeypatch, "atropos-llama-full", 0, 1e-2, 4)
    assert not loop.model.lora
    prompt = AutoTokenizer.from_pretrained(str(llama)).encode("w7 w8")
    replies = [100, 200, 100, 200]
    group = {
        "tokens": [prompt + [r] for r in replies],
        "masks": [[-100] * len(prompt) + [r] for r in replies],
        "scores": [1.0 if r == 100 else 0.0 for r in replies],
    }
    before = {k: v.clone() for k, v in loop.sampler.model.state_dict().items()}
    loop.learn([group])
    after = loop.sampler.model.state_dict()
    assert loop.sampler.version == 1
    assert not torch.equal(before["hf.model.embed_tokens.weight"], after["hf.model.embed_tokens.weight"])


def test_a_base_model_it_does_not_serve_fails_the_config_or_the_start_in_one_line(
    tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (TINY_LM, SMOLLM2) == (served.TINY_LM, smollm2.NAME)  # the names a config takes before models load
    with pytest.raises(ConfigError) as refused:
        parse_config(_config(tmp_path, "bad", base_model="my-lama"))
    line = str(refused.value).splitlines()[1]
    assert line.startswith(
        "  trainer.atropos.base_model: 'my-lama' is no model this trainer serves; one of "
        "tiny-byte-lm, HuggingFaceTB/SmolLM2-135M-Instruct, my-llama"
    ), line
    monkeypatch.setenv("TA_TOKEN", RUN_TOKEN)
    missing = parse_config(_config(tmp_path / "nowhere", "missing"))
    with pytest.raises(FatalError) as failed:
        AtroposLoop(missing, redis_client, tmp_path / "run", torch.device("cpu"))
    assert str(failed.value) == (
        f"trainer.tinker.base_models['my-llama']: model folder {tmp_path / 'nowhere'}: no such folder"
    )
    # the tiny LM's tokenizer, written once into the run folder for the environments
    tiny = parse_config({"trainer": {"experience_loop": False, "atropos": {"enabled": True}}})
    written = AutoTokenizer.from_pretrained(tokenizer_folder(tiny, tmp_path))
    assert written.encode("hé", add_special_tokens=False) == tiny_lm.ByteTokenizer().encode("hé")
