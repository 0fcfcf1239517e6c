"""In the worker: the forward_backward requests of LoRA models of one base that are ready together
run as one batched pass, and every model ends as it would have with ``trainer.tinker.batch_models`` off (each in its
own lane): its responses, its steps, its parameters, what each step tells the trainer's log. A request with a bad
datum fails alone, and a worker restarted after a batched pass replays each model's accumulation alone to the same
state."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinker_atropos.config import Config, parse_config
from tinker_atropos.tinker_api.engine import training_steps
from tinker_atropos.tinker_api.engine.worker import Worker
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.queue import DONE, FAILED
from tinker_atropos.training.served import TINY_LM

MODELS = [f"s:train:{i}" for i in range(3)]
BAD = MODELS[1]  # its first forward_backward holds a token past the vocabulary


def _config(**tinker: object) -> Config:
    return parse_config(
        {
            "run": {"name": "grouped"},
            "env": {"id": "Pendulum-v1"},
            "trainer": {"experience_loop": False, "tinker": {"enabled": True, **tinker}},
        }
    )


def _forward_backward(model: str, seq: int) -> bytes:
    rng = np.random.default_rng(seq * 10 + MODELS.index(model))
    data = []
    for length in rng.integers(4, 12, 2):
        tokens = [int(t) for t in rng.integers(0, 256, length + 1)]
        if model == BAD and seq == 1:
            tokens[2] = 300
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64)},
            )
        )
    request = types.ForwardBackwardRequest(
        types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model, seq
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _store(client: redis.Redis, run: str, folder: Path) -> Store:
    """Three LoRA models of the tiny LM (ranks 4, 8, 8), each two forward_backward + optim_step."""
    store = Store(client, run, folder)
    step = json.dumps({"adam_params": {"learning_rate": 0.05}}).encode()
    for index, model in enumerate(MODELS):
        store.models.add(
            model,
            {"base_model": TINY_LM, "lora": {"rank": 4 if index == 0 else 8, "seed": index}, "session": "s"},
        )
        store.requests.submit("create_model", b"", model, seq=0)
        for seq in (1, 3):
            store.requests.submit("forward_backward", _forward_backward(model, seq), model, seq=seq)
            store.requests.submit("optim_step", step, model, seq=seq + 1)
    return store


def _adapters(worker: Worker) -> dict[str, torch.Tensor]:
    return {
        model: torch.cat(
            [
                p.detach().flatten()
                for p in worker.requests.models[model].core.model.parameters()
                if p.requires_grad
            ]
        )
        for model in MODELS
    }


def _losses(store: Store, model: str) -> list[float]:
    found = []
    for seq in (1, 3):
        result = store.requests.result(store.requests.op(model, seq))
        if result.status == DONE:
            found.append(pb.ForwardBackwardOutput.FromString(result.body).metrics["loss:sum"])
    return found


def _tokens(model: str, seq: int) -> int:
    """The positions of ``_forward_backward(model, seq)``'s data."""
    return int(np.random.default_rng(seq * 10 + MODELS.index(model)).integers(4, 12, 2).sum())


class Told:
    """What a worker's steps told its log: (tag, step) -> value."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, int], float] = {}

    def __call__(self, points: Mapping[str, float], step: int) -> None:
        self.points |= {(tag, step): value for tag, value in points.items()}


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many requests each batched pass ran."""
    counted: list[int] = []
    run_losses = training_steps.run_losses

    def counting(runs: list) -> list:
        counted.append(len(runs))
        return run_losses(runs)

    monkeypatch.setattr(training_steps, "run_losses", counting)
    return counted


def test_a_batched_pass_leaves_every_model_as_its_own_lane_would_and_a_bad_datum_fails_alone(
    redis_client: redis.Redis, tmp_path: Path, passes: list[int]
) -> None:
    apart_store = _store(redis_client, "apart", tmp_path / "apart")
    told_apart, told = Told(), Told()
    apart = Worker(
        apart_store, redis_client, _config(batch_models=False), torch.device("cpu"), training_log=told_apart
    )
    while apart.step():
        pass
    assert passes == []

    store = _store(redis_client, "together", tmp_path / "together")
    worker = Worker(store, redis_client, _config(), torch.device("cpu"), training_log=told)
    worker.passes = 1  # one pass of all three whatever this machine's cores
    while worker.step():
        pass
    assert passes == [3, 3]  # each round's three forward_backward in one pass
    failed = store.requests.result(store.requests.op(BAD, 1))
    assert failed.status == FAILED and json.loads(failed.body)["category"] == "user"
    assert "datum" in json.loads(failed.body)["error"]
    for model in MODELS:
        statuses = [store.requests.result(store.requests.op(model, seq)).status for seq in range(1, 5)]
        assert statuses == [FAILED if model == BAD and seq == 1 else DONE for seq in range(1, 5)]
        np.testing.assert_allclose(_losses(store, model), _losses(apart_store, model), rtol=1e-5)
    for model, adapter in _adapters(worker).items():
        torch.testing.assert_close(adapter, _adapters(apart)[model], atol=1e-5, rtol=1e-4)
    # each model's steps, tagged by its id at its version: the loss and tokens of the passes since its last step
    # (the bad model's first step had none); no grad_norm, as no step was clipped
    assert told.points.keys() == told_apart.points.keys()
    for (tag, step), value in told.points.items():
        assert value == pytest.approx(told_apart.points[tag, step], rel=1e-5), (tag, step)
    for model in MODELS:
        assert [told.points[f"tinker/{model}/tokens", step] for step in (1, 2)] == [
            0 if model == BAD else _tokens(model, 1),
            _tokens(model, 3),
        ]
        # its second step's: the loss its second forward_backward answered
        assert told.points[f"tinker/{model}/loss", 2] == pytest.approx(_losses(store, model)[-1], rel=1e-6)
    assert {tag.rsplit("/", 1)[1] for tag, _ in told.points} == {"loss", "tokens"}


def test_a_restart_after_a_batched_pass_replays_each_models_accumulation(
    redis_client: redis.Redis, tmp_path: Path, passes: list[int]
) -> None:
    reference = Worker(
        _store(redis_client, "reference", tmp_path / "reference"),
        redis_client,
        _config(),
        torch.device("cpu"),
    )
    reference.passes = 1
    while reference.step():
        pass

    store = _store(redis_client, "restarted", tmp_path / "restarted")
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    worker.passes = 1
    worker.step(), worker.step()  # created, then the first round's gradients accumulated in one pass
    assert [store.models.progress(model)[0] for model in MODELS] == [1, 1, 1]
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    worker.passes = 1
    worker.recover()
    while worker.step():
        pass
    assert passes == [
        3,
        3,
        3,
        3,
    ]  # the reference's two, the first round's before the restart, the second's after
    for model, adapter in _adapters(worker).items():
        torch.testing.assert_close(adapter, _adapters(reference)[model], atol=1e-5, rtol=1e-4)
