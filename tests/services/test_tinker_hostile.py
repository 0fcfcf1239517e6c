"""Hostile requests and many clients against a real trainer process, through the unmodified SDK (tinker 0.38.0)
where the SDK can send them: every refusal of a numbered request leaves its number answered, so the model's next
request completes (a refused number used to wedge the model for ever); a request whose arrays would take gigabytes
once densified, or whose shape overflows, is a 400 before anything is allocated; budgets name their config field;
one client's long sampling does not hold another's training; and at the end the trainer is alive and learning."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types import RequestErrorCategory

from tests.support.processes import wait_for
from tests.support.tinker_server import KEY, Raw, TinkerTrainer, sdk_session, serving
from tinker_atropos.models.tiny_lm import ByteTokenizer, TinyLMConfig
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration

LM = "tiny-byte-lm"
TOK = ByteTokenizer()
IDS = TOK.encode("hostile input, and the model goes on.", add_bos=True)
MAX_REQUEST_TOKENS = 4096


def lm_datum(ids: list[int], **inputs: types.TensorData) -> types.Datum:
    targets = {"target_tokens": np.asarray(ids[1:], np.int64)} | inputs
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=targets)


GOOD = lm_datum(IDS)


def _rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


# a module on the trainer's import path, as one in the folder `up` starts in is
PLANTED = "planted_by_a_client"


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the module ``PLANTED``, which, imported, writes ``marker`` with its process's id."""
    folder = tmp_path_factory.mktemp("planted")
    marker = folder / "marker"
    (folder / f"{PLANTED}.py").write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n")
    return folder


@pytest.fixture(scope="module")
def trainer(
    valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory, planted: Path
) -> Iterator[TinkerTrainer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(planted))
        with serving(
            tmp_path_factory.mktemp("tk-hostile"),
            valkey.url,
            "tk-hostile",
            long_poll_s=0.5,
            max_request_mb=2,
            max_request_tokens=MAX_REQUEST_TOKENS,
        ) as server:
            yield server


@pytest.fixture
def service(trainer: TinkerTrainer) -> Iterator[tinker.ServiceClient]:
    with sdk_session(trainer) as client:
        yield client


def learns(client: tinker.TrainingClient) -> float:
    """One cross-entropy step then the loss it left: completes, whatever came before on this model."""
    client.forward_backward([GOOD], "cross_entropy").result(timeout=60)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    return client.forward([GOOD], "cross_entropy").result(timeout=60).metrics["loss:sum"]


def _nan_learning_rate(client: tinker.TrainingClient) -> None:
    client.optim_step(types.AdamParams(learning_rate=float("nan"))).result(timeout=60)


def _over_the_size_limit(client: tinker.TrainingClient) -> None:  # one datum of 3 MB; max_request_mb is 2
    noise = np.random.default_rng(0).normal(size=3 << 18).astype(np.float32)
    big = lm_datum(
        IDS[:2], weights=types.TensorData(data=noise.tolist(), dtype="float32", shape=[1, noise.size])
    )
    client.forward_backward([big], "cross_entropy").result(timeout=60)


def _sparse_of_a_huge_shape(client: tinker.TrainingClient) -> None:  # 127 bytes that densify to 2 GB
    huge = types.TensorData(
        data=[], dtype="int64", shape=[2, 125_000_000], sparse_crow_indices=[0, 0, 0], sparse_col_indices=[]
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": huge}
    )
    client.forward_backward([datum], "cross_entropy").result(timeout=60)


def _past_the_token_budget(client: tinker.TrainingClient) -> None:
    long = [lm_datum(IDS) for _ in range(MAX_REQUEST_TOKENS // (len(IDS) - 1) + 1)]
    client.forward_backward(long, "cross_entropy").result(timeout=60)


def _unknown_checkpoint(client: tinker.TrainingClient) -> None:
    client.load_state("tinker://session-0000:train:0/weights/none").result(timeout=60)


def _an_export_of_the_tiny_lm(client: tinker.TrainingClient) -> None:  # refused by the worker: no HF model
    client.save_weights_external("exported").result(timeout=60)


def _token_outside_the_vocabulary(client: tinker.TrainingClient) -> None:  # refused by the worker
    client.forward_backward([lm_datum([*IDS, TinyLMConfig.vocab_size])], "cross_entropy").result(timeout=60)


@pytest.mark.parametrize(
    ("send", "status", "message"),
    [
        pytest.param(_nan_learning_rate, 400, "learning_rate", id="validation"),
        pytest.param(_over_the_size_limit, 413, "max_request_mb", id="size"),
        pytest.param(_sparse_of_a_huge_shape, 400, "max_request_mb", id="memory"),
        pytest.param(_past_the_token_budget, 400, "max_request_tokens", id="token-budget"),
        pytest.param(_unknown_checkpoint, 404, "no checkpoint", id="unknown-model"),
        pytest.param(_an_export_of_the_tiny_lm, None, "neither transformers nor PEFT", id="export"),
        pytest.param(_token_outside_the_vocabulary, None, "target_tokens", id="shape"),
    ],
)
def test_a_refused_request_leaves_its_number_answered_and_the_model_goes_on(
    service: tinker.ServiceClient,
    trainer: TinkerTrainer,
    send: Callable[[tinker.TrainingClient], None],
    status: int | None,
    message: str,
) -> None:
    """Refused at the route (a status) or by the worker (a failed future of the user's category): either way the
    SDK raises, and the model's next request completes instead of waiting for the refused number for ever."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    before = learns(client)
    rss = _rss_mb(trainer.process.pid)
    with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as refused:
        send(client)
    error = refused.value
    if status is None:  # a user error found where the request is applied
        assert (
            isinstance(error, tinker.RequestFailedError) and error.category == types.RequestErrorCategory.User
        )
    else:
        assert isinstance(error, tinker.APIStatusError) and error.status_code == status, error
    assert message in str(error), error
    assert learns(client) < before  # the next requests of the same model completed, and it learned
    assert _rss_mb(trainer.process.pid) < rss + 200  # nothing of the refused request's size was allocated
    assert trainer.process.poll() is None


class _Planted:
    """Unpickled, writes the marker: what ``torch.load(weights_only=False)`` of a planted file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",)


@pytest.mark.parametrize(
    "base_model", ["mlp-gaussian/this:Nothing", "mlp-gaussian/os:system", f"mlp-categorical/{PLANTED}:Env"]
)
def test_no_field_of_a_request_names_code_the_trainer_runs(
    service: tinker.ServiceClient, trainer: TinkerTrainer, planted: Path, base_model: str
) -> None:
    """A base-model name ``<policy>/<module>:<name>`` reached an import in the trainer (the Zen
    of Python in its log; a module planted on its import path ran). Now a name is looked up among the models
    listed, a 400 naming them otherwise, for a training and a sampling client alike. Nor does a checkpoint path
    climb out of the checkpoint folder to a pickle planted beside it."""
    for create in (service.create_lora_training_client, service.create_sampling_client):
        with pytest.raises(tinker.APIStatusError) as refused:
            create(base_model=base_model).result(timeout=60)
        answer = str(refused.value)  # the models served, named
        assert refused.value.status_code == 400 and f"serves mlp-gaussian/Pendulum-v1, {LM}" in answer, answer
    # tinker://../weights/planted, seen from the checkpoint folder
    beside = trainer.run_dir / "weights" / "planted.pt"
    beside.parent.mkdir(exist_ok=True)
    torch.save({"record": _Planted(planted / "marker")}, beside)
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    with pytest.raises(tinker.APIStatusError) as refused:
        client.load_state("tinker://../weights/planted").result(timeout=60)
    assert refused.value.status_code == 404, refused.value
    assert not (planted / "marker").exists(), (planted / "marker").read_text()
    assert "Beautiful is better than ugly" not in trainer.log()
    assert learns(client) and trainer.process.poll() is None


@pytest.mark.parametrize("name", [".", "..", ""])
def test_a_checkpoint_name_that_is_no_file_name_is_a_400_and_writes_nothing(
    service: tinker.ServiceClient, trainer: TinkerTrainer, name: str
) -> None:
    """``save_weights_external(name='.')`` wrote into ``external_weights/`` itself. Every save
    refuses a name that is no file name of its own, naming the field; the model's next requests go on."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    learns(client)
    folder = trainer.run_dir / "tinker" / client.model_id.replace(":", "_")
    before = sorted(p for p in folder.rglob("*") if not p.name.startswith("state-"))
    for save in (client.save_state, client.save_weights_for_sampler, client.save_weights_external):
        with pytest.raises(tinker.APIStatusError) as refused:
            save(name).result(timeout=60)
        assert refused.value.status_code == 400 and f"path {name!r}" in str(refused.value), refused.value
    assert sorted(p for p in folder.rglob("*") if not p.name.startswith("state-")) == before
    assert learns(client)


def _tensor(shape: list[int], dtype: int, sparse: bool) -> pb.Tensor:
    tensor = pb.Tensor(dtype=dtype, shape=shape)
    if sparse:
        tensor.sparse_csr.crow_indices = np.zeros(shape[0] + 1, np.int64).tobytes()
    return tensor


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        ("weights", _tensor([2**32, 2**32], pb.DTYPE_FLOAT32, sparse=False)),
        ("target_tokens", _tensor([2, 2**62], pb.DTYPE_INT64, sparse=True)),
        ("weights", _tensor([-1, 37], pb.DTYPE_FLOAT32, sparse=False)),
    ],
    ids=["dense-2^32x2^32", "sparse-2x2^62", "negative-dimension"],
)
def test_an_overflowing_shape_is_a_400_not_a_500(
    service: tinker.ServiceClient, trainer: TinkerTrainer, name: str, tensor: pb.Tensor
) -> None:
    """Shapes the SDK itself would not build, sent by hand: a 400 naming the input, and the model goes on."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    before = learns(client)  # numbers 1 to 3
    request = pb.ForwardBackwardRequest(model_id=client.model_id, seq_id=4, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(IDS[:-1], np.int32).tobytes()
    datum.loss_fn_inputs[name].CopyFrom(tensor)
    with httpx.Client(base_url=trainer.url, headers={"X-API-Key": KEY}, timeout=30) as http:
        answer = http.post(
            "/api/v1/forward_backward",
            content=request.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
    assert answer.status_code == 400 and name in answer.json()["detail"], answer.text
    assert learns(client) < before  # the SDK's own number 4 then went through
    assert trainer.process.poll() is None


def _unauthenticated(trainer: TinkerTrainer, redis_client: redis.Redis) -> int:
    """The trainer's count of requests refused for their key, as its status shows it (in the registry)."""
    records = live_services(redis_client, trainer.run, "trainer")
    return records[0].figures.get("tinker_events", {}).get("requests_unauthenticated", 0) if records else 0


def test_requests_without_an_allowed_key_change_nothing(
    service: tinker.ServiceClient, trainer: TinkerTrainer, redis_client: redis.Redis
) -> None:
    """A local user without the key reads the victim's model id (the run folder's names) and
    posts its next numbers, keyless or with a wrong key. Each is a 401 that notes nothing: the victim's own
    next requests complete, the refusals are counted in the trainer's status, and the folder that names the
    models is private to the run's user. (The SDK's own later number 4 with the right key is what runs.)"""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    before = learns(client)  # numbers 1, 2 and 3
    counted = _unauthenticated(trainer, redis_client)
    keyless, wrong = Raw(trainer.url, key=""), Raw(trainer.url, key="tml-wrong-key-0123456789abcdef")
    try:
        for seq in range(4, 34):
            for raw in (keyless, wrong):
                with pytest.raises(httpx.HTTPStatusError) as refused:
                    raw.forward_backward(client.model_id, seq, [GOOD], "cross_entropy")
                assert refused.value.response.status_code == 401
            with pytest.raises(httpx.HTTPStatusError) as refused:
                keyless.optim_step(client.model_id, seq, types.AdamParams(learning_rate=1.0))
            assert refused.value.response.status_code == 401
    finally:
        keyless.close()
        wrong.close()
    assert learns(client) < before  # numbers 4, 5 and 6 of the victim: its own, applied
    assert (trainer.run_dir / "tinker").stat().st_mode & 0o777 == 0o700
    wait_for(
        lambda: _unauthenticated(trainer, redis_client) >= counted + 90, 15, "the refusals in the status"
    )


def test_stop_as_the_sdk_documents_it(service: tinker.ServiceClient) -> None:
    """``stop=None`` ends at the end-of-sequence token; ``stop=[]`` disables every stop token, EOS included."""
    client = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    text = TOK.encode("end", add_bos=True) + [TOK.eos_id]
    for _ in range(60):  # the model learns to say "end" then EOS
        client.forward_backward([lm_datum(text)], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2))
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = types.ModelInput.from_ints(text[:2])
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=0.0)).result(
        timeout=60
    )
    assert stopped.sequences[0].tokens[-1] == TOK.eos_id and stopped.sequences[0].stop_reason == "stop"
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=[])
    free = sampler.sample(prompt, 1, params).result(timeout=60).sequences[0]
    assert len(free.tokens) == 20 and free.stop_reason == "length", free.tokens
    assert TOK.eos_id in free.tokens  # it went past the end-of-sequence token
    # stop strings end where the decoded text first holds one, its last token kept (as the hosted service does)
    for stop, expected in (("n", "n"), (["d", "x"], "nd"), ("nd", "nd")):
        params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=stop)
        out = sampler.sample(prompt, 1, params).result(timeout=60).sequences[0]
        assert TOK.decode(out.tokens) == expected and out.stop_reason == "stop", (stop, out.tokens)
    with pytest.raises(tinker.RequestFailedError) as mixed:  # the SDK sends the list as given
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=[""])).result(timeout=60)
    assert mixed.value.category == RequestErrorCategory.User and "non-empty strings" in mixed.value.message


def test_a_sample_past_the_token_budget_is_refused_and_sampling_goes_on(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=LM).result(timeout=60)
    prompt = types.ModelInput.from_ints(IDS)
    with pytest.raises(tinker.APIStatusError) as refused:
        sampler.sample(prompt, 64, types.SamplingParams(max_tokens=100)).result(timeout=60)
    assert refused.value.status_code == 400 and "max_request_tokens" in str(refused.value)
    assert (
        len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8)).result(timeout=60).sequences) == 2
    )


SIZE = (2 << 20) - 1024  # just under this trainer's max_request_mb
EMPTIES = b",".join([b"[]"] * (SIZE // 3))  # the most values per byte: [[],[],...]


def _protobuf_of_empty_datums() -> bytes:
    head = pb.ForwardBackwardRequest(model_id="session-x:train:0", seq_id=1, loss_fn="cross_entropy")
    return head.SerializeToString() + b"\x1a\x00" * ((SIZE - 64) // 2)


def _json(template: bytes) -> bytes:
    return template.replace(b"FILL", EMPTIES)


def _vm_kb(pid: int, field: str) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split(f"{field}:")[1].split()[0])


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        pytest.param(
            "create_session",
            b'{"tags":[' + b",".join([b"1"] * (SIZE // 2)) + b'],"sdk_version":"0"}',
            400,
            id="sessions-tags-of-integers",
        ),
        pytest.param(
            "create_model",
            _json(b'{"session_id":"s","model_seq_id":0,"base_model":"x","user_metadata":{"a":[FILL]}}'),
            400,
            id="sessions-metadata",
        ),
        pytest.param(
            "optim_step",
            _json(b'{"model_id":"session-x:train:0","seq_id":1,"optim_params":[FILL]}'),
            400,
            id="training-json",
        ),
        pytest.param("forward_backward", _protobuf_of_empty_datums(), 400, id="training-protobuf"),
        pytest.param(
            "asample",
            _json(b'{"num_samples":1,"prompt":{"chunks":[FILL]},"sampling_params":{}}'),
            400,
            id="sampling",
        ),
        pytest.param("weights_info", _json(b'{"tinker_path":[FILL]}'), 400, id="runs"),
        pytest.param(
            "copy_weights",
            _json(b'{"source_tinker_path":"tinker://x/weights/y","x":[FILL]}'),
            404,
            id="service-unserved",
        ),
    ],
)
def test_a_body_up_to_max_request_mb_costs_little_memory_and_never_holds_healthz(
    trainer: TinkerTrainer, route: str, body: bytes, status: int
) -> None:
    """A keyed client's body under max_request_mb whose parsing would build far more than its
    bytes (a value per 2 or 3 bytes: each an object, and a validation error each where the type is wrong) is
    refused for what it holds, costing the trainer at most 10 x its size at its peak (VmHWM, reset first), while
    a health check polled all along answers within 1 s each."""
    pid = trainer.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here
    before, slowest, done = _vm_kb(pid, "VmRSS"), [0.0], threading.Event()

    def poll_healthz() -> None:
        with httpx.Client(base_url=trainer.url, headers={"X-API-Key": KEY}, timeout=10) as http:
            while not done.is_set():
                start = time.perf_counter()
                assert http.get("/api/v1/healthz").status_code == 200
                slowest[0] = max(slowest[0], time.perf_counter() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_healthz)
    poller.start()
    try:
        kind = "application/x-protobuf" if route == "forward_backward" else "application/json"
        with httpx.Client(
            base_url=trainer.url, headers={"X-API-Key": KEY, "Content-Type": kind}, timeout=60
        ) as http:
            start = time.perf_counter()
            answer = http.post(f"/api/v1/{route}", content=body)
            took = time.perf_counter() - start
    finally:
        done.set()
        poller.join()
    peak_mb = (_vm_kb(pid, "VmHWM") - before) / 1024
    print(
        f"{route}: {len(body) / 2**20:.1f} MiB answered {answer.status_code} in {took:.2f} s; peak +{peak_mb:.0f} "
        f"MB, after +{(_vm_kb(pid, 'VmRSS') - before) / 1024:.0f} MB; slowest healthz {slowest[0]:.2f} s"
    )
    assert answer.status_code == status, answer.text[:300]
    assert slowest[0] < 1.0 and took < 2.0
    assert peak_mb <= 10 * len(body) / 2**20


def test_the_trainer_took_no_crash(trainer: TinkerTrainer) -> None:
    """After the hostile requests above: the same process, and no traceback of an unexpected error."""
    assert trainer.process is not None and trainer.process.poll() is None and trainer.starts == 1
    assert "Traceback" not in trainer.log(), trainer.log()[-3000:]


def test_one_clients_long_sampling_does_not_hold_another_models_training(
    service: tinker.ServiceClient,
) -> None:
    """While one client samples for 30 s, another client's forward_backward + optim_step
    on another model takes at most twice its time alone (the medians of rounds measured in this test: alone
    before and after, and all through the 30 s, on whatever else shares the machine). Each model and each sampler
    is a lane of its own; sampling runs in a process of its own and waits for training requests."""
    trained = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
    rng = np.random.default_rng(1)
    data = [lm_datum([TOK.bos_id, *rng.integers(0, 256, size=200).tolist()]) for _ in range(8)]
    adam = types.AdamParams(learning_rate=1e-3)

    def round_trip() -> float:
        start = time.perf_counter()
        fwd, opt = trained.forward_backward(data, "cross_entropy"), trained.optim_step(adam)
        fwd.result(timeout=120), opt.result(timeout=120)
        return time.perf_counter() - start

    sampler = service.create_sampling_client(base_model=LM).result(timeout=60)
    prompt = types.ModelInput.from_ints(IDS)
    # the sampling process up
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result(timeout=120)
    for _ in range(2):  # warm-up
        round_trip()
    alone = [round_trip() for _ in range(10)]
    params = types.SamplingParams(max_tokens=450, stop=[])  # 7 x 487 tokens: within this trainer's budget
    sampled, errors, sampling_until = [], [], time.monotonic() + 30

    def sample_for_30_s() -> None:
        try:
            while time.monotonic() < sampling_until:
                sampled.append(sampler.sample(prompt, 7, params).result(timeout=120))
        except Exception as error:  # the test's assertion below shows it
            errors.append(error)

    thread = threading.Thread(target=sample_for_30_s)
    thread.start()
    time.sleep(1)  # the first sample under way
    during = []
    while time.monotonic() < sampling_until - 1:
        during.append(round_trip())
    thread.join()
    alone += [round_trip() for _ in range(10)]
    ratio = statistics.median(during) / statistics.median(alone)
    print(
        f"forward_backward + optim_step: median {statistics.median(alone):.3f} s alone, "
        f"{statistics.median(during):.3f} s while another client samples ({ratio:.2f}x, {len(during)} rounds); "
        f"{len(sampled)} samples of 7 x 450 tokens in 30 s"
    )
    assert not errors and sampled and all(len(s.sequences[0].tokens) == 450 for s in sampled), errors
    assert len(during) >= 5 and ratio <= 2, (alone, during)
