"""The trainer's side of Atropos: batches as Tinker datums (group-relative advantages, masks, behaviour
log-probs), the tiny LM's tokenizer as a Hugging Face folder, the inference endpoint as atroposlib's own clients
call it, and the Atropos loop's optimizer steps raising the score of a toy preference."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from transformers import AutoTokenizer

from tinker_atropos.config import parse_config
from tinker_atropos.frontends.atropos.datums import BatchError, batch_datums, group_advantages
from tinker_atropos.frontends.inference.app import build_app
from tinker_atropos.frontends.inference.sampler import Sampler
from tinker_atropos.models import tiny_lm
from tinker_atropos.runtime import free_port
from tinker_atropos.trainer.atropos_loop import AtroposLoop

TOKENIZER = tiny_lm.ByteTokenizer()


def test_advantages_are_relative_to_the_group_and_an_all_equal_group_teaches_nothing() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], None) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0], [{}, {"set_advantage_to_zero": True}]) == [0.5, 0.0]
    assert group_advantages([0.3, 0.3, 0.3], None) is None


def test_a_batch_becomes_shifted_token_datums_weighted_by_the_mask_with_the_sentinel_zeroed() -> None:
    prompt, a, b = [256, 104, 105], [97, 257], [98, 98, 257]
    group = {"tokens": [prompt + a, prompt + b], "masks": [[-100] * 3 + a, [-100] * 3 + b], "scores": [1.0, 0.0],
             "inference_logprobs": [[1.0] * 3 + [-0.5, -0.1], [1.0] * 3 + [-2.0, -1.0, -0.2]]}  # fmt: skip
    equal = {"tokens": [prompt + a, prompt + a], "masks": [[-100] * 3 + a] * 2, "scores": [1.0, 1.0]}
    out = batch_datums([group, equal])
    assert out.groups_skipped_equal == 1 and len(out.data) == 2 and out.scores == [1.0, 0.0, 1.0, 1.0]
    first, second = out.data
    np.testing.assert_array_equal(first.tokens, prompt + a[:-1])
    np.testing.assert_array_equal(first.inputs["target_tokens"], prompt[1:] + a)
    np.testing.assert_array_equal(
        first.inputs["weights"], [0, 0, 1, 1]
    )  # targets in the prompt weigh nothing
    np.testing.assert_allclose(
        first.inputs["logprobs"], [0, 0, -0.5, -0.1]
    )  # the sentinel 1.0 never reaches a loss
    trained = 2 + 3  # the batch's trained tokens: advantages are a per-token mean
    np.testing.assert_allclose(first.inputs["advantages"], np.array([0, 0, 0.5, 0.5]) / trained)
    np.testing.assert_allclose(second.inputs["advantages"], np.array([0, 0, -0.5, -0.5, -0.5]) / trained)
    given = {
        **group,
        "advantages": [[0, 0, 0, 2.0, 2.0], [0, 0, 0, 1.0, 1.0, 1.0]],
    }  # an env's own, per token
    np.testing.assert_allclose(
        batch_datums([given]).data[0].inputs["advantages"], np.array([0, 0, 2, 2]) / trained
    )
    with pytest.raises(BatchError, match="3 log-probs for 5 tokens"):
        batch_datums([{**group, "inference_logprobs": [[1.0] * 3, None]}])


def test_the_tokenizer_folder_loads_offline_and_encodes_and_chats_as_the_tiny_lm(tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(TOKENIZER.save_pretrained(tmp_path / "tok")))
    text = "héllo, wörld"
    assert hf.encode(text, add_special_tokens=False) == TOKENIZER.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id) == (TOKENIZER.bos_id, TOKENIZER.eos_id)
    messages = [("system", "be brief"), ("user", "hi")]
    rendered = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                      add_generation_prompt=True)  # fmt: skip
    assert rendered == tiny_lm.chat_prompt(messages)


class Endpoint:
    """The inference app on a free port in a thread of the test process."""

    def __init__(self, sampler: Sampler) -> None:
        self.port = free_port()
        config = uvicorn.Config(build_app(sampler, "tiny-byte-lm"), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_atroposlibs_own_clients_sample_tokens_and_logprobs_of_the_served_version(tmp_path: Path) -> None:
    model = tiny_lm.TinyCausalLM(tiny_lm.TinyLMConfig())
    sampler = Sampler(model, version=3)
    tokenizer_dir = str(TOKENIZER.save_pretrained(tmp_path / "tok"))
    with Endpoint(sampler) as url:
        config = APIServerConfig(model_name="tiny-byte-lm", base_url=f"{url}/v1", api_key="x", tokenizer_name=tokenizer_dir,
                                 timeout=30, health_check=False)  # fmt: skip
        prompt = TOKENIZER.encode("ab", add_bos=True)

        async def calls() -> tuple:
            sglang, openai_server = SGLangServer(config), OpenAIServer(config)
            sampled = await sglang._tokens_and_logprobs_completion_wrapper(
                model="tiny-byte-lm", input_ids=prompt, n=3, max_tokens=5, temperature=1.0)  # fmt: skip
            completion = await openai_server._completion_wrapper(model="tiny-byte-lm", prompt="ab", n=2, max_tokens=4,
                                                                 logprobs=1)  # fmt: skip
            chat = await openai_server._chat_completion_wrapper(model="tiny-byte-lm", max_tokens=4,
                                                                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
            return sampled, completion, chat

        (_, tokens, logprobs, reasons), completion, chat = asyncio.run(calls())
        assert len(tokens) == 3 and all(1 <= len(t) <= 5 for t in tokens)
        assert all(r["type"] in ("length", "stop") for r in reasons)
        # the log-probs are the model's for exactly these tokens
        for t, lps in zip(tokens, logprobs, strict=True):
            expected = tiny_lm.target_logprobs(model, *_shifted(prompt + t)).detach().numpy()[-len(t) :]
            np.testing.assert_allclose(lps, expected, atol=1e-4)
        assert len(completion.choices) == 2 and len(completion.choices[0].logprobs.token_logprobs) >= 1
        assert chat.choices[0].message.role == "assistant"
        sampler.update(model, 4)
        assert httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).json()[
            "meta_info"]["policy_version"] == 4  # fmt: skip
        too_long = httpx.post(f"{url}/generate", json={"input_ids": [1] * 600, "sampling_params": {}})
        assert too_long.status_code == 400 and "context" in too_long.json()["detail"]


def _shifted(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(tokens)
    return t[:-1], t[1:]


def test_the_atropos_loop_raises_the_score_of_the_preferred_completion(
    tmp_path: Path, valkey, redis_client
) -> None:
    """Groups where the completion 'a' scores 1 and 'b' scores 0, with the served policy's log-probs of each: a
    few importance-sampling steps make 'a' the likelier reply, and every step serves a new version."""
    config = parse_config({"run": {"name": "atropos-loop"}, "trainer": {
        "experience_loop": False, "atropos": {"enabled": True, "learning_rate": 1e-2, "batch_size": 8}}})  # fmt: skip
    loop = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"))
    prompt = TOKENIZER.encode("pick:", add_bos=True)
    a, b = TOKENIZER.encode("a")[0], TOKENIZER.encode("b")[0]

    def served_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return loop.sampler._model(torch.tensor([prompt]))[0, -1].log_softmax(-1)

    def p_a() -> float:
        probs = served_logprobs().exp()
        return float(probs[a] / (probs[a] + probs[b]))

    before = p_a()
    for step in range(1, 13):
        logprobs = served_logprobs()
        replies = [a, b] * 4
        group = {"tokens": [prompt + [r] for r in replies], "masks": [[-100] * len(prompt) + [r] for r in replies],
                 "scores": [1.0 if r == a else 0.0 for r in replies],
                 "inference_logprobs": [[1.0] * len(prompt) + [float(logprobs[r])] for r in replies]}  # fmt: skip
        loop.learn([group])
        assert loop.sampler.version == step and np.isfinite(loop.figures["loss"])
    assert p_a() > max(0.9, before + 0.3), (before, p_a())
    assert loop.counters["sequences_trained"] == 12 * 8
    assert int(redis_client.hget("ta:atropos-loop:stats", "episodes")) == 12 * 8
    loop._checkpoint()
    resumed = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"))
    assert (resumed.step, resumed.sampler.version) == (12, 12)
