"""The trainer's side of Atropos: batches as Tinker datums (group-relative advantages, masks, behaviour
log-probs), the tiny LM's tokenizer as a Hugging Face folder, the inference endpoint as atroposlib's own clients
call it, and the Atropos loop's optimizer steps raising the score of a toy preference."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from tests.support.asserts import assert_names_nothing_of_the_package, assert_same
from tests.support.atropos import (
    Poller,
    chunked,
    join_as_env,
    memory_kb,
    reference_api,
    reset_peak,
    start_atropos_trainer,
    tiny_lm_group,
)
from tests.support.processes import Processes, wait_for
from tinker_atropos.config import parse_config
from tinker_atropos.frontends.http import run_key
from tinker_atropos.frontends.inference.app import build_app
from tinker_atropos.frontends.inference.sampler import Sampler
from tinker_atropos.models import tiny_lm
from tinker_atropos.processes import free_port
from tinker_atropos.state.registry import live_services
from tinker_atropos.trainer.atropos_loop import AtroposLoop
from tinker_atropos.trainer.checkpointing import Checkpointer
from tinker_atropos.trainer.tensorboard import run_log
from tinker_atropos.training.atropos_batches import batch_datums, group_advantages, policy_figures
from tinker_atropos.training.data import Datum

TOKENIZER = tiny_lm.ByteTokenizer()
KEY = "inference-key-of-the-test"
RUN_TOKEN = "the-run-token"  # of the trainer processes: their inference endpoint asks the key derived from it


def test_advantages_are_relative_to_the_group_and_an_all_equal_group_teaches_nothing() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], None) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0], [{}, {"set_advantage_to_zero": True}]) == [0.5, 0.0]
    assert group_advantages([0.3, 0.3, 0.3], None) is None


def test_a_batch_becomes_shifted_token_datums_weighted_by_the_mask_with_the_sentinel_zeroed() -> None:
    prompt, a, b = [256, 104, 105], [97, 257], [98, 98, 257]
    group = {
        "tokens": [prompt + a, prompt + b],
        "masks": [[-100] * 3 + a, [-100] * 3 + b],
        "scores": [1.0, 0.0],
        "inference_logprobs": [[1.0] * 3 + [-0.5, -0.1], [1.0] * 3 + [-2.0, -1.0, -0.2]],
    }
    equal = {"tokens": [prompt + a, prompt + a], "masks": [[-100] * 3 + a] * 2, "scores": [1.0, 1.0]}
    out = batch_datums([group, equal])
    assert out.groups_skipped_equal == 1 and len(out.data) == 2 and out.scores == [1.0, 0.0, 1.0, 1.0]
    # the reward of every answer, those of the group that scored alike too; lengths in trained tokens
    assert out.figures() == {
        "score_mean": 0.75,
        "score_std": pytest.approx(0.75**0.5 / 2),
        "answer_tokens_mean": (2 + 3 + 2 + 2) / 4,
    }
    assert out.answer_tokens() == (9, 5)  # sampled, learned from
    first, second = out.data
    np.testing.assert_array_equal(first.tokens, prompt + a[:-1])
    np.testing.assert_array_equal(first.inputs["target_tokens"], prompt[1:] + a)
    # targets in the prompt weigh nothing
    np.testing.assert_array_equal(first.inputs["weights"], [0, 0, 1, 1])
    # the sentinel 1.0 never reaches a loss
    np.testing.assert_allclose(first.inputs["logprobs"], [0, 0, -0.5, -0.1])
    trained = 2 + 3  # the batch's trained tokens: advantages are a per-token mean
    np.testing.assert_allclose(first.inputs["advantages"], np.array([0, 0, 0.5, 0.5]) / trained)
    np.testing.assert_allclose(second.inputs["advantages"], np.array([0, 0, -0.5, -0.5, -0.5]) / trained)
    # an env's own, per token
    given = {
        **group,
        "advantages": [[0, 0, 0, 2.0, 2.0], [0, 0, 0, 1.0, 1.0, 1.0]],
    }
    np.testing.assert_allclose(
        batch_datums([given]).data[0].inputs["advantages"], np.array([0, 0, 2, 2]) / trained
    )
    # a malformed group is skipped with its reason; the batch's sound group is learned all the same
    mixed = batch_datums([{**group, "inference_logprobs": [[1.0] * 3, None]}, given])
    assert [p.split(":")[0] for p in mixed.groups_invalid] == ["group 0"], mixed.groups_invalid
    assert "3 log-probs for 5 tokens" in mixed.groups_invalid[0] and len(mixed.data) == 2


def test_sampler_and_learner_apart_are_the_k3_kl_the_sampled_entropy_and_the_share_ppo_clips() -> None:
    """Over the trained tokens only: ratios learner/sampler 1.5, 0.5, 1 and 1.5, advantages +, -, + and -; PPO's
    clipped term is taken past 1.2 for a positive advantage and below 0.8 for a negative one (2 of 4 tokens)."""
    sampler = np.array([0.0, -1.0, -2.0, -0.5], np.float32)
    first = Datum(
        tokens=np.zeros(4, np.int64),
        inputs={
            "weights": np.array([0, 1, 1, 1], np.float32),
            "logprobs": sampler,
            "advantages": np.array([0, 1, -1, 1], np.float32),
        },
    )
    second = Datum(
        tokens=np.zeros(1, np.int64),
        inputs={
            "weights": np.ones(1, np.float32),
            "logprobs": np.array([-1.0], np.float32),
            "advantages": -np.ones(1, np.float32),
        },
    )
    learner = [
        sampler + np.log([9.0, 1.5, 0.5, 1.0]).astype(np.float32),
        np.array([-1.0 + np.log(1.5)], np.float32),
    ]
    ratios = np.array([1.5, 0.5, 1.0, 1.5])
    figures = policy_figures([first, second], learner, (0.8, 1.2))
    assert figures["kl_sampler_learner"] == pytest.approx(np.mean(ratios - 1 - np.log(ratios)), rel=1e-5)
    assert figures["entropy"] == pytest.approx((1.0 + 2.0 + 0.5 + 1.0) / 4)
    assert figures["clip_fraction"] == 0.5
    assert "clip_fraction" not in policy_figures([first], learner[:1], None)  # no clipping loss: not measured


def test_the_tokenizer_folder_loads_offline_and_encodes_and_chats_as_the_tiny_lm(tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(TOKENIZER.save_pretrained(tmp_path / "tok")))
    text = "héllo, wörld"
    assert hf.encode(text, add_special_tokens=False) == TOKENIZER.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id) == (TOKENIZER.bos_id, TOKENIZER.eos_id)
    messages = [("system", "be brief"), ("user", "hi")]
    rendered = hf.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
    )
    assert rendered == tiny_lm.chat_prompt(messages)


class Endpoint:
    """The inference app on a free port in a thread of the test process."""

    def __init__(self, sampler: Sampler) -> None:
        self.port, self.sampler = free_port(), sampler
        config = uvicorn.Config(
            build_app(sampler, "tiny-byte-lm", [KEY], 8 << 20),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
        )
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
        self.sampler.close()


def test_atroposlibs_own_clients_sample_tokens_and_logprobs_of_the_served_version(tmp_path: Path) -> None:
    model = tiny_lm.TinyCausalLM(tiny_lm.TinyLMConfig())
    sampler = Sampler(model, version=3)
    tokenizer_dir = str(TOKENIZER.save_pretrained(tmp_path / "tok"))
    with Endpoint(sampler) as url:
        config = APIServerConfig(
            model_name="tiny-byte-lm",
            base_url=f"{url}/v1",
            api_key=KEY,
            tokenizer_name=tokenizer_dir,
            timeout=30,
            health_check=False,
        )
        prompt = TOKENIZER.encode("ab", add_bos=True)

        async def calls() -> tuple:
            sglang, openai_server = SGLangServer(config), OpenAIServer(config)
            sampled = await sglang._tokens_and_logprobs_completion_wrapper(
                model="tiny-byte-lm", input_ids=prompt, n=3, max_tokens=5, temperature=1.0
            )
            completion = await openai_server._completion_wrapper(
                model="tiny-byte-lm", prompt="ab", n=2, max_tokens=4, logprobs=1
            )
            chat = await openai_server._chat_completion_wrapper(
                model="tiny-byte-lm", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
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
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"})
        generated = http.post(
            "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
        )
        assert generated.json()["meta_info"]["policy_version"] == 4
        too_long = http.post("/generate", json={"input_ids": [1] * 600, "sampling_params": {}})
        assert too_long.status_code == 400 and "context" in too_long.json()["detail"]
        # the run's key is asked on every route but the health check
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
            refused = httpx.post(f"{url}/generate", json={"input_ids": prompt}, headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
        assert httpx.get(f"{url}/health").status_code == 200


def _shifted(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(tokens)
    return t[:-1], t[1:]


def test_the_atropos_loop_raises_the_score_of_the_preferred_completion(
    tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups where the completion 'a' scores 1 and 'b' scores 0, with the served policy's log-probs of each: a
    few importance-sampling steps make 'a' the likelier reply, and every step serves a new version and writes its
    curves to TensorBoard, an evaluation's figures as they come."""
    monkeypatch.setenv("TA_TOKEN", "the-run-token")  # the inference endpoint's key is derived from it
    config = parse_config(
        {
            "run": {"name": "atropos-loop"},
            "trainer": {
                "experience_loop": False,
                "atropos": {"enabled": True, "learning_rate": 1e-2, "batch_size": 8},
            },
        }
    )
    tensorboard = run_log(config, redis_client, tmp_path / "run")
    loop = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"), tensorboard)
    prompt = TOKENIZER.encode("pick:", add_bos=True)
    a, b = TOKENIZER.encode("a")[0], TOKENIZER.encode("b")[0]

    def served_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return loop.sampler.model(torch.tensor([prompt]))[0, -1].log_softmax(-1)

    def p_a() -> float:
        probs = served_logprobs().exp()
        return float(probs[a] / (probs[a] + probs[b]))

    before = p_a()
    for step in range(1, 13):
        logprobs = served_logprobs()
        replies = [a, b] * 4
        group = {
            "tokens": [prompt + [r] for r in replies],
            "masks": [[-100] * len(prompt) + [r] for r in replies],
            "scores": [1.0 if r == a else 0.0 for r in replies],
            "inference_logprobs": [[1.0] * len(prompt) + [float(logprobs[r])] for r in replies],
        }
        if step == 6:  # an evaluation ended
            loop.figures = loop.figures | {"eval/accuracy": 0.5}
        loop.learn([group])
        assert loop.sampler.version == step and np.isfinite(loop.figures["loss"])
    assert p_a() > max(0.9, before + 0.3), (before, p_a())
    assert tensorboard is not None
    tensorboard.close()
    _assert_curves(tmp_path / "run" / "tensorboard", steps=12)
    assert loop.counters["sequences_trained"] == 12 * 8
    assert int(redis_client.hget("ta:atropos-loop:stats", "episodes")) == 12 * 8
    Checkpointer(loop, loop.folder, config.trainer.checkpoint, None).save(force=True)
    # plain data: it loads wherever the classes move
    assert_names_nothing_of_the_package(tmp_path / "run" / "atropos" / "checkpoint-0000000012.pt")
    resumed = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"))
    Checkpointer(resumed, resumed.folder, config.trainer.checkpoint, None).resume()
    assert (resumed.step, resumed.sampler.version) == (12, 12)


def _assert_curves(folder: Path, steps: int) -> None:
    """The Atropos loop's TensorBoard curves of ``steps`` steps of the preference groups: every answer scored
    1 or 0 half and half, one token long, sampled by the policy the learner was (no KL); the throughput from the
    second step on; the evaluation once."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    every_step = {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "answers/length_mean": 1.0,
        "policy/kl_sampler_learner": 0.0,
    }
    for tag, value in every_step.items():
        points = events.Scalars(tag)
        assert [p.step for p in points] == list(range(1, steps + 1)), tag
        assert all(p.value == pytest.approx(value, abs=1e-4) for p in points), (tag, points)
    for tag in ("policy/entropy", "train/loss", "train/grad_norm", "time/step_s", "time/weight_sync_s"):
        assert len(events.Scalars(tag)) == steps, tag
    for tag in ("throughput/sampled_tokens_per_s", "throughput/trained_tokens_per_s"):
        assert len(events.Scalars(tag)) == steps - 1 and all(p.value > 0 for p in events.Scalars(tag)), tag
    assert [(p.step, p.value) for p in events.Scalars("eval/accuracy")] == [(6, 0.5)]
    assert "policy/clip_fraction" not in events.Tags()["scalars"]  # importance sampling clips nothing


def test_a_step_that_comes_out_nonfinite_is_undone_and_counted(
    tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores near float32's limit make the gradients overflow: the step is undone (parameters, optimizer
    moments and version as before it, the served weights unchanged) and counted in the trainer's status."""
    monkeypatch.setenv("TA_TOKEN", "the-run-token")
    config = parse_config(
        {
            "run": {"name": "atropos-nonfinite"},
            "trainer": {"experience_loop": False, "atropos": {"enabled": True, "batch_size": 4}},
        }
    )
    loop = AtroposLoop(config, redis_client, tmp_path / "run", torch.device("cpu"))
    prompt, replies = TOKENIZER.encode("pick:", add_bos=True), TOKENIZER.encode("abab")

    def group(good: float) -> dict[str, list]:
        return {
            "tokens": [prompt + [r] for r in replies],
            "masks": [[-100] * len(prompt) + [r] for r in replies],
            "scores": [good if r == replies[0] else -good for r in replies],
        }

    loop.learn([group(1.0)])  # a sound step first: the optimizer moments exist
    before = copy.deepcopy(loop.model.state_dict())

    loop.learn([group(3e38)])

    assert_same(loop.model.state_dict(), before)
    assert loop.sampler.version == loop.model.core.version == 1
    assert loop.status().updates_discarded_nonfinite == 1 and loop.counters["sequences_trained"] == 4


@pytest.mark.integration
def test_groups_the_model_cannot_read_are_skipped_and_counted_and_the_trainer_learns_on(
    tmp_path: Path, valkey, redis_client, processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our trainer process learning from atroposlib's own run-api, which queues whatever it is sent: in one batch,
    a sound group, one with a token outside the tiny LM's vocabulary and one past its context. The two are skipped
    and counted, the sound one learned from (a trainer used to exit on such a batch, its sound groups lost), and
    the next batch is learned from as well."""
    with reference_api(tmp_path / "reference.log") as api_url:
        atropos = {"api_url": api_url, "batch_size": 12, "max_token_len": 1024, "inference_port": free_port()}
        trainer = _start_trainer(tmp_path, processes, valkey.url, monkeypatch, "atropos-hostile", **atropos)
        api = httpx.Client(base_url=api_url, timeout=30)
        join_as_env(api, processes, trainer, batch_size=12, name="hostile", max_token_length=1024)

        def trainer_figures() -> dict:
            services = live_services(redis_client, "atropos-hostile", "trainer")
            return services[0].figures if services else {}

        for posted in (tiny_lm_group(1), tiny_lm_group(2, (97, 300)), tiny_lm_group(3, (97,) * 600)):
            api.post("/scored_data", json=posted).raise_for_status()
        wait_for(lambda: trainer_figures().get("updates", 0) >= 1, 120, "the trainer's first step")
        figures = trainer_figures()
        assert figures["losses"]["groups_invalid"] == 2 and figures["losses"]["sequences_trained"] == 4, (
            figures
        )
        assert figures["policy_version"] == 1
        for seed in (4, 5, 6):
            api.post("/scored_data", json=tiny_lm_group(seed, (97, 98, 99))).raise_for_status()
        wait_for(lambda: trainer_figures().get("updates", 0) >= 2, 120, "the trainer's second step")
        assert trainer_figures()["policy_version"] == 2 and trainer.poll() is None
        log = processes.log("trainer")
        # the reasons
        assert "must lie in [0, 258)" in log and "the model's context is 512" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        # its /batch polls (ten a second while no batch is ready) are not logged one by one
        assert "HTTP Request:" not in log and "/batch" not in log, log[-3000:]


def _start_trainer(
    tmp_path: Path,
    processes: Processes,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    run: str,
    **atropos: Any,
) -> subprocess.Popen:
    """A trainer process of run ``run`` running the Atropos loop (``atropos``: its settings) and serving the
    inference endpoint, with the run token ``RUN_TOKEN`` (the endpoint asks the key derived from it)."""
    monkeypatch.setenv("TA_TOKEN", RUN_TOKEN)
    return start_atropos_trainer(processes, redis_url, tmp_path / "run", run, **atropos)


# ------------------------------------------------------------------------------ bodies bounded by what they build

MAX_MB = 8  # trainer.atropos.inference_max_request_mb's default


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.integration
def test_hostile_bodies_to_the_inference_endpoint_cost_under_ten_times_their_size_while_health_answers(
    tmp_path: Path, valkey, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyed, to a trainer process serving the endpoint, bodies of up to its 8 MiB: a prompt of 1.5 million
    tokens and one just past the 65,536 bound, a million bad token ids, a 7 MB text prompt, lists of lists and of
    objects, stop strings and messages past their bounds, a gzip bomb (the endpoint inflates nothing) and a
    chunked post past the bound. Each is refused with its reason, the trainer's peak memory grows by less than
    ten times each body and returns, ``/health`` answers within a second throughout (the endpoint used to parse
    and validate on its event loop, for seconds, and report every bad item), and the endpoint samples after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer = _start_trainer(
        tmp_path, processes, valkey.url, monkeypatch, "atropos-bodies", inference_port=port
    )
    key = run_key("inference", RUN_TOKEN)
    sample = {"prompt": "ab", "max_tokens": 2, "logprobs": 1}
    n = 1_500_000  # "1000," is 5 bytes: 7.5 MB of JSON
    hostile = {  # what: route, body, the answer's status and what it says
        "prompt tokens": ("/generate", {"input_ids": [1000] * n}, 413, "JSON values"),
        "past 65,536 tokens": ("/v1/completions", {"prompt": [1000] * 70_000}, 422, "at most 65536"),
        "bad ids": ("/v1/completions", {"prompt": ["x"] * 1_000_000}, 413, "JSON values"),
        "long text": ("/generate", {"text": "a" * 7_000_000}, 400, "the context is 512"),
        "lists": ("/v1/completions", {"prompt": [[]] * 100_000}, 413, "arrays and objects"),
        "objects": ("/generate", {"input_ids": [{"a": 1234567}] * 100_000}, 413, "arrays and objects"),
        "stops": ("/v1/completions", {**sample, "stop": [7] * 100_000}, 422, "at most 16"),
        "messages": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}] * 5000},
            422,
            "at most 4096",
        ),
    }
    bodies = {what: _json(body) for what, (_, body, _, _) in hostile.items()}
    bodies["gzip bomb"] = gzip.compress(b" " * (64 << 20), 1)  # 64 MiB of spaces, inflated
    hostile["gzip bomb"] = ("/v1/completions", None, 400, "not JSON")
    assert max(len(body) for body in bodies.values()) < MAX_MB << 20
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:

        def sampled() -> bool:
            assert trainer.poll() is None, processes.log("trainer")[-3000:]
            try:
                return client.post("/v1/completions", json=sample).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(sampled, 120, "the trainer's inference endpoint")  # what sampling takes is in the baseline
        rss_before = memory_kb(trainer.pid, "VmRSS")
        answers, growth_mb = {}, {}
        started = time.monotonic()
        with Poller(f"{url}/health", {}) as poller:
            for what, (path, _, _, _) in hostile.items():
                reset_peak(trainer.pid)
                start = memory_kb(trainer.pid, "VmRSS")
                encoding = {"Content-Encoding": "gzip"} if what == "gzip bomb" else {}
                answers[what] = client.post(path, content=bodies[what], headers=encoding)
                growth_mb[what] = (memory_kb(trainer.pid, "VmHWM") - start) / 1024
            over = client.post("/generate", content=chunked(MAX_MB + 1))
            after_mb = (memory_kb(trainer.pid, "VmRSS") - rss_before) / 1024
            for what, (path, _, _, _) in hostile.items():  # the same again: nothing kept per request
                encoding = {"Content-Encoding": "gzip"} if what == "gzip bomb" else {}
                client.post(path, content=bodies[what], headers=encoding)
            again_mb = (memory_kb(trainer.pid, "VmRSS") - rss_before) / 1024 - after_mb
        elapsed_s = time.monotonic() - started
        after = client.post("/v1/completions", json=sample)
    sizes_mb = {what: len(body) / 2**20 for what, body in bodies.items()}
    growth = {w: (round(growth_mb[w]), round(sizes_mb[w], 1)) for w in bodies}
    print(
        f"{elapsed_s:.1f} s; slowest /health {poller.slowest:.2f} s of {poller.answers}; "
        f"RSS {after_mb:+.0f} MiB after, {again_mb:+.0f} after them again; peak growth (MiB) for a body of (MiB): {growth}"
    )
    for what, (_, _, status, reason) in hostile.items():
        answer = answers[what]
        shown = (what, answer.status_code, answer.text[:500])
        assert answer.status_code == status and reason in answer.text, shown
        if status == 422:  # however many items are bad, five errors and a count at most
            assert len(answer.json()["detail"]) <= 6, (what, answer.text[:2000])
        # 8 MiB: a baseline (the answer, a thread's allocations) that a body of a few kB costs as well
        assert growth_mb[what] < 10 * sizes_mb[what] + 8, (what, growth_mb[what], sizes_mb[what])
    assert over.status_code == 413 and "trainer.atropos.inference_max_request_mb" in over.text, over.text
    # asked throughout (four answers a second at least: one every 20 ms and the time it took)
    polled = (poller.slowest, poller.answers, elapsed_s)
    assert poller.slowest < 1.0 and poller.answers >= 4 * elapsed_s, polled
    # what the bodies took is handed back but for what the allocator keeps for later (17-28 MiB measured), and
    # the same bodies again keep nothing more
    assert after_mb < 4 * MAX_MB and again_mb < MAX_MB, (after_mb, again_mb)
    assert after.status_code == 200 and after.json()["choices"][0]["logprobs"]["token_ids"], after.text
