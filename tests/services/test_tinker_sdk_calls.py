"""The SDK's calls that the other Tinker tests leave out, through the unmodified SDK against a real trainer: top-k
log-probs of a prompt and of sampled tokens (those of the model the sampler serves, its LoRA adapter applied, as
its own forward gives them), scoring a prompt's last positions only, the log-prob options refused with the field
named; and the smaller calls of the training, sampling and REST clients (``docs/tinker.md``'s compatibility table
names the test of each call)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from tests.support.tinker_server import KEY, TinkerTrainer, sdk_session, serving
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyLMConfig
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

LM = "tiny-byte-lm"
TOK = ByteTokenizer()
IDS = TOK.encode("tinker-atropos learns to speak.\n", add_bos=True) + [TOK.eos_id]
VOCAB = TinyLMConfig.vocab_size
ADAM = types.AdamParams(learning_rate=1e-2)
ROUNDING = 1e-4  # two forwards of one model in float32, batched differently


@pytest.fixture(scope="module")
def trainer(valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerTrainer]:
    with serving(tmp_path_factory.mktemp("tk-calls"), valkey.url, "tk-calls", long_poll_s=0.5) as server:
        yield server


@pytest.fixture
def service(trainer: TinkerTrainer) -> Iterator[tinker.ServiceClient]:
    with sdk_session(trainer) as client:
        yield client


def lm_datum(ids: list[int], targets: list[int] | None = None) -> types.Datum:
    """Next-token cross-entropy: the model reads ids[:-1], scored on ``targets`` (by default ids[1:])."""
    targets = ids[1:] if targets is None else targets
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(targets, np.int64),
            "weights": np.ones(len(targets), np.float32),
        },
    )


def trained(service: tinker.ServiceClient, steps: int) -> tinker.TrainingClient:
    """A LoRA model a few steps away from its base: its adapter is no longer the identity."""
    client = service.create_lora_training_client(base_model=LM, rank=8).result(timeout=60)
    for _ in range(steps):
        client.forward_backward([lm_datum(IDS)], "cross_entropy").result(timeout=60)
        client.optim_step(ADAM).result(timeout=60)
    return client


def distributions(client: tinker.TrainingClient, inputs: list[list[int]]) -> list[np.ndarray]:
    """Our own forward, through the training client: log p(v | inputs[:t+1]) [len, vocab] for each input, read as
    the cross-entropy log-probs of every token v in turn at every position."""
    data = [lm_datum([*ids, 0], [v] * len(ids)) for ids in inputs for v in range(VOCAB)]
    outputs = client.forward(data, "cross_entropy").result(timeout=120).loss_fn_outputs
    columns = [out["logprobs"].to_numpy() for out in outputs]
    return [np.stack(columns[i * VOCAB : (i + 1) * VOCAB], axis=1) for i in range(len(inputs))]


def check_topk(topk: TopkLogprobs, reference: np.ndarray, k: int) -> None:
    """``topk`` [n, k] are the k most likely tokens of ``reference`` [n, vocab] with its log-probs, sorted."""
    ids, lps = topk.token_ids, topk.logprobs
    assert ids.shape == lps.shape == (len(reference), k)
    assert np.all(np.diff(lps, axis=1) <= 0)  # most likely first
    np.testing.assert_allclose(np.take_along_axis(reference, ids.astype(np.int64), 1), lps, atol=ROUNDING)
    best = reference.argmax(-1)
    clear = np.sort(reference, -1)[:, -1] - np.sort(reference, -1)[:, -2] > ROUNDING
    assert clear.mean() > 0.5 and np.array_equal(ids[clear, 0], best[clear])  # top-1: our forward's argmax
    np.testing.assert_allclose(lps[:, 0], reference.max(-1), atol=ROUNDING)
    outside = reference.copy()
    np.put_along_axis(outside, ids.astype(np.int64), -np.inf, 1)
    assert np.all(outside.max(-1) <= lps[:, -1] + ROUNDING)  # nothing left out is more likely


def test_top_k_log_probs_are_the_served_models_own_at_every_position(service: tinker.ServiceClient) -> None:
    client = trained(service, steps=12)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    base = service.create_sampling_client(base_model=LM).result(timeout=60)
    prompt = IDS[:12]
    response = sampler.sample(
        types.ModelInput.from_ints(prompt),
        2,
        types.SamplingParams(max_tokens=6, seed=4),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=5,
        topk_sample_logprobs=3,
    ).result(timeout=60)
    sequences = [list(s.tokens) for s in response.sequences]
    own = distributions(client, [prompt[:-1]] + [prompt + s[:-1] for s in sequences])

    topk = response.topk_prompt_logprobs_np
    assert topk is not None and response.topk_prompt_logprobs is not None
    assert response.topk_prompt_logprobs[0] is None  # nothing predicts the first token
    check_topk(TopkLogprobs(topk.token_ids[1:], topk.logprobs[1:]), own[0], 5)
    # the distribution of prompt_logprobs: our forward's, and a prompt token among the top 5 has its log-prob there
    scored = np.asarray(response.prompt_logprobs[1:], np.float32)
    np.testing.assert_allclose(scored, own[0][np.arange(len(prompt) - 1), prompt[1:]], atol=ROUNDING)
    # our forward says at which positions the prompt's token is among the 5 most likely (ties at the 5th left out)
    fifth, sixth = np.sort(own[0], -1)[:, -5], np.sort(own[0], -1)[:, -6]
    true_lp = own[0][np.arange(len(prompt) - 1), prompt[1:]]
    inside = {p + 1 for p in np.flatnonzero(true_lp >= fifth + ROUNDING)}
    outside = {p + 1 for p in np.flatnonzero(true_lp <= sixth - ROUNDING)}
    assert inside  # the adapter learnt the prompt: some of its tokens are among the most likely
    for position, row in enumerate(response.topk_prompt_logprobs[1:], 1):
        found = dict(row or [])
        if position in inside:
            assert abs(found[prompt[position]] - response.prompt_logprobs[position]) < 1e-5
        if position in outside:
            assert prompt[position] not in found

    for sequence, seq, reference in zip(response.sequences, sequences, own[1:], strict=True):
        assert sequence.topk_logprobs_np is not None and sequence.logprobs is not None
        check_topk(sequence.topk_logprobs_np, reference[len(prompt) - 1 :], 3)
        for token, logprob, row in zip(seq, sequence.logprobs, sequence.topk_logprobs or [], strict=True):
            found = dict(row or [])  # temperature 1, nothing cut: what was sampled from is the model's own
            assert token not in found or abs(found[token] - logprob) < ROUNDING

    # the adapter is applied: the base's top-k differ
    plain = (
        base.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=5
        )
        .result(timeout=60)
        .topk_prompt_logprobs_np
    )
    assert plain is not None and np.abs(plain.logprobs[1:] - topk.logprobs[1:]).max() > 0.01


def test_the_last_n_prompt_positions_are_scored_alone(service: tinker.ServiceClient) -> None:
    sampler = trained(service, steps=1).save_weights_and_get_sampling_client().result(timeout=60)
    prompt, params = types.ModelInput.from_ints(IDS[:10]), types.SamplingParams(max_tokens=1)
    whole = sampler.sample(prompt, 1, params, True, topk_prompt_logprobs=4).result(timeout=60)
    last = sampler.sample(prompt, 1, params, True, topk_prompt_logprobs=4, prompt_logprobs_last_n=3).result(
        timeout=60
    )
    assert last.prompt_logprobs is not None and whole.prompt_logprobs is not None
    assert last.prompt_logprobs[:7] == [None] * 7 and last.topk_prompt_logprobs[:7] == [None] * 7
    np.testing.assert_allclose(last.prompt_logprobs[7:], whole.prompt_logprobs[7:], atol=1e-6)
    assert last.topk_prompt_logprobs_np is not None and whole.topk_prompt_logprobs_np is not None
    np.testing.assert_array_equal(
        last.topk_prompt_logprobs_np.token_ids[7:], whole.topk_prompt_logprobs_np.token_ids[7:]
    )


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs must lie in [0, 20], got -1"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs must lie in [0, 20], got 21"),
        ({"topk_sample_logprobs": -2}, "topk_sample_logprobs must lie in [0, 20], got -2"),
        (
            {"include_prompt_logprobs": True, "prompt_logprobs_last_n": 5},
            "prompt_logprobs_last_n must lie in [1, 4]",
        ),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not served"),
        (
            {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((4, 1), 65, np.int64))},
            "target_prompt_logprobs is not served",
        ),
    ],
    ids=[
        "negative-k",
        "k-past-the-cap",
        "negative-sample-k",
        "last-n-past-the-prompt",
        "alt-tokens",
        "target-logprobs",
    ],
)
def test_log_prob_options_out_of_range_are_refused_naming_the_field(
    service: tinker.ServiceClient, options: dict, named: str
) -> None:
    sampler = service.create_sampling_client(base_model=LM).result(timeout=60)
    prompt, params = types.ModelInput.from_ints(IDS[:5]), types.SamplingParams(max_tokens=2)
    with pytest.raises(tinker.APIStatusError) as refused:
        sampler.sample(prompt, 1, params, **options).result(timeout=60)
    assert refused.value.status_code == 400 and named in str(refused.value)
    assert len(sampler.sample(prompt, 1, params).result(timeout=60).sequences) == 1  # it serves on


def test_the_smaller_calls_of_the_training_sampling_and_rest_clients(
    service: tinker.ServiceClient, trainer: TinkerTrainer
) -> None:
    """load_state[_with_optimizer], a loss made by create_custom_loss, a sampler's handle, base model and record,
    delete_checkpoint by run and checkpoint id, and the deprecated create_rest_client."""
    client = trained(service, steps=1)
    datum = lm_datum(IDS)
    saved = client.save_state("one-step").result(timeout=60).path

    def scored() -> np.ndarray:
        return (
            client.forward([datum], "cross_entropy")
            .result(timeout=60)
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )

    before = scored()
    for load in (client.load_state, client.load_state_with_optimizer):
        client.forward_backward([datum], "cross_entropy").result(timeout=60)
        client.optim_step(ADAM).result(timeout=60)
        assert np.abs(scored() - before).max() > 1e-3  # the step moved it
        with pytest.warns(FutureWarning, match="deprecated"):
            load(saved).result(timeout=60)
        np.testing.assert_allclose(scored(), before, atol=1e-6)

    def nll(logprobs: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss}

    loss = service.create_custom_loss(nll, input_ranks={"logprobs": 1, "weights": 1}).result(timeout=60)
    custom = client.forward_backward_custom([datum], loss).result(timeout=60)
    assert np.isclose(custom.metrics["custom/nll:sum"], -before.sum(), rtol=1e-4)

    sampler_path = client.save_weights_for_sampler("one-step").result(timeout=60).path
    sampler = client.create_sampling_client(sampler_path).result(timeout=60)
    assert sampler.get_base_model() == LM
    handle = sampler.get_sampler_handle()
    # the client names its sampler's id nowhere but in its handle
    sampler_id = json.loads(base64.urlsafe_b64decode(handle))["sampling_session_id"]
    record = tinker.RestClient(base_url=trainer.url, api_key=KEY).get_sampler(sampler_id).result(timeout=30)
    assert (record.base_model, record.model_path) == (LM, sampler_path)
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY)
    made = tinker.SamplingClient.create(service.holder, model_path=sampler_path).result(timeout=60)
    params = types.SamplingParams(max_tokens=6, seed=2)
    prompt = types.ModelInput.from_ints(IDS[:4])
    drawn = [
        [s.tokens for s in c.sample(prompt, 2, params).result(timeout=60).sequences]
        for c in (sampler, again, made)
    ]
    assert drawn[0] == drawn[1] == drawn[2]  # one sampler's weights, whichever client

    with pytest.warns(FutureWarning, match="deprecated"):
        rest = service.create_rest_client()
    assert saved in {
        c.tinker_path for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
    }
    rest.delete_checkpoint(client.model_id, "weights/one-step").result(timeout=30)
    assert saved not in {
        c.tinker_path for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
    }
