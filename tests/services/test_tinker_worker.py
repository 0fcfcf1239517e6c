"""The Tinker API's worker in-process, where a crash can be placed exactly: a request is applied once whatever
instant the process dies at, and a session whose client went silent is finished with its models unloaded."""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.asserts import assert_names_nothing_of_the_package, assert_same
from tinker_atropos.config import Config, parse_config
from tinker_atropos.state.run_dir import LOCK_NAME, OWNER_VARIABLE, Holder, RunFolderInUse, RunFolderOwner
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.worker import Worker
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.files import tinker_path
from tinker_atropos.tinker_api.store.queue import DONE, FAILED, PENDING
from tinker_atropos.tinker_api.store.samplers import sampler_lane

MODEL = "s:train:0"
T = 8


def _config(**tinker: object) -> Config:
    return parse_config(
        {
            "run": {"name": "worker"},
            "env": {"id": "Pendulum-v1"},
            "trainer": {"experience_loop": False, "tinker": {"enabled": True, **tinker}},
        }
    )


def _store(client: redis.Redis, run: str, folder: Path, **tinker: object) -> Store:
    """The store of ``run`` with its checkpoints in ``folder``, as the trainer makes it of ``_config(**tinker)``."""
    section = _config(**tinker).trainer.tinker
    return Store(client, run, folder, section.future_ttl_s, section.ephemeral_weights_ttl_s)


def _forward_backward(seq: int, advantage: float | None = None) -> bytes:
    """A PPO datum of the Pendulum policy; every advantage ``advantage`` if given."""
    rng = np.random.default_rng(0)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([0] * T),
        loss_fn_inputs={
            "observations": rng.normal(size=(T, 3)).astype(np.float32),
            "actions": rng.normal(size=(T, 1)).astype(np.float32),
            "logprobs": np.full(T, -1.0, np.float32),
            "advantages": rng.normal(size=T).astype(np.float32)
            if advantage is None
            else np.full(T, advantage, np.float32),
        },
    )
    request = types.ForwardBackwardRequest(
        types.ForwardBackwardInput(data=[datum], loss_fn="ppo"), MODEL, seq
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _queue(store: Store) -> None:
    store.models.add(MODEL, {"base_model": "mlp-gaussian/Pendulum-v1", "lora": {}, "session": "s"})
    store.requests.submit("create_model", b"", MODEL, seq=0)
    store.requests.submit("forward_backward", _forward_backward(1), MODEL, seq=1)
    store.requests.submit(
        "optim_step", json.dumps({"adam_params": {"learning_rate": 0.1}}).encode(), MODEL, seq=2
    )


def _parameters(worker: Worker) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in worker.requests.models[MODEL].core.model.parameters()])


class Crash(BaseException):
    """The process dying: nothing after it runs."""


@pytest.mark.parametrize("dies", ["after the snapshot file, before the store points at it", "never"])
def test_a_step_is_applied_once_whatever_instant_the_trainer_dies_at(
    redis_client: redis.Redis, tmp_path: Path, dies: str
) -> None:
    reference_store = _store(redis_client, "reference", tmp_path / "reference")
    _queue(reference_store)
    reference = Worker(reference_store, redis_client, _config(), torch.device("cpu"))
    while reference.step():
        pass

    store = _store(redis_client, "crashing", tmp_path / "crashing")
    _queue(store)
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    worker.step(), worker.step()  # created, gradients accumulated
    if dies == "never":
        worker.step()
    else:
        finish = store.requests.finish

        def dying(*args: object, **kwargs: object) -> None:
            if kwargs.get("snapshot") is not None:
                raise Crash()
            finish(*args, **kwargs)

        store.requests.finish = dying  # type: ignore[method-assign]
        with pytest.raises(Crash):
            worker.step()
        store.requests.finish = finish  # type: ignore[method-assign]
        worker = Worker(store, redis_client, _config(), torch.device("cpu"))
        worker.recover()
        while worker.step():
            pass

    assert store.models.progress(MODEL)[:2] == (2, 2)
    assert worker.requests.models[MODEL].core.version == reference.requests.models[MODEL].core.version == 1
    assert torch.equal(_parameters(worker), _parameters(reference))
    assert len(list((tmp_path / "crashing").glob("*/state-*.pt"))) == 1  # the older snapshots are gone


def test_a_snapshot_holds_plain_data_that_loads_wherever_the_classes_move(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = _store(redis_client, "plain", tmp_path)
    _queue(store)
    store.requests.submit("save_weights", json.dumps({"path": "saved"}).encode(), MODEL, seq=3)
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    while worker.step():
        pass
    [snapshot] = tmp_path.glob("*/state-*.pt")
    assert_names_nothing_of_the_package(snapshot)
    assert_names_nothing_of_the_package(store.files.file_of(tinker_path(MODEL, "weights", "saved")))


def test_a_step_that_comes_out_nonfinite_is_undone_and_counted(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Advantages near float32's limit make the gradients overflow: the step is undone (parameters, optimizer
    moments and version as before it, what the one non-finite guard does for every driver), counted, and
    answered as the client's error."""
    store = _store(redis_client, "nonfinite", tmp_path)
    _queue(store)
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    while worker.step():  # a sound step first: the optimizer moments exist
        pass
    model = worker.requests.models[MODEL]
    before = copy.deepcopy(model.state_dict())
    store.requests.submit("forward_backward", _forward_backward(3, advantage=3e38), MODEL, seq=3)
    step = store.requests.submit(
        "optim_step", json.dumps({"adam_params": {"learning_rate": 0.1}}).encode(), MODEL, seq=4
    )
    while worker.step():
        pass
    failed = store.requests.result(step)
    assert failed.status == FAILED and json.loads(failed.body)["category"] == "user"
    assert "non-finite; it was undone" in json.loads(failed.body)["error"]
    assert_same(model.state_dict(), before)
    assert worker.guard.undone == 1


def test_a_silent_session_is_finished_and_its_models_unloaded(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = _store(redis_client, "expiry", tmp_path)
    session = store.sessions.create({})
    model = f"{session}:train:0"
    store.models.add(model, {"base_model": "mlp-gaussian/Pendulum-v1", "lora": {}, "session": session})
    store.requests.submit("create_model", b"", model, seq=0)
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    worker.step()
    timeout = _config().trainer.tinker.session_timeout_s
    snapshots = list(store.files.folder(model).glob("state-*.pt"))
    assert snapshots and tmp_path.stat().st_mode & 0o777 == 0o700  # the models' folder: the run user's only

    worker.expiry.check(worker.requests.models)  # a live client: nothing happens
    assert store.sessions.state(session) == "" and store.models.is_loaded(model)

    redis_client.hset(f"ta:expiry:tinker:session:{session}", "heartbeat_at", time.time() - timeout - 1)
    # the worker itself started less than the timeout ago: every client gets it again
    worker.expiry.check(worker.requests.models)
    assert store.sessions.state(session) == ""

    worker.expiry.started -= timeout
    worker.expiry.next_check = 0.0
    worker.expiry.check(worker.requests.models)
    while worker.step():
        pass
    assert store.sessions.state(session) == "heartbeat_expired"
    assert not store.models.is_loaded(model) and model not in worker.requests.models
    assert worker.expiry.expired == {"sessions_expired": 1, "models_expired": 1}
    assert not store.files.folder(model).exists()  # its snapshot went with it


def test_a_sample_past_its_time_budget_fails_naming_it_and_one_cut_by_a_shutdown_stays_queued(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = _store(redis_client, "budget", tmp_path)
    sampler = f"{store.sessions.create({})}:sample:0"
    store.samplers.add(sampler, "tiny-byte-lm", None)
    body = {
        "sampling_session_id": sampler,
        "prompt": {"chunks": [{"tokens": [256, 104, 105]}]},
        "num_samples": 2,
        "sampling_params": {"max_tokens": 50},
    }
    request_id = store.requests.submit(
        "sample", json.dumps(body).encode(), lane=sampler_lane("tiny-byte-lm", None)
    )
    worker = Worker(store, redis_client, _config(max_request_s=1e-6), torch.device("cpu"))
    try:
        worker.stopping.set()  # the trainer stops while the sample runs: it is left to run after the restart
        assert worker.step()
        assert store.requests.result(request_id).status == PENDING
        worker.stopping.clear()
        assert worker.step()  # in the sampling process
        failed = store.requests.result(request_id)
        assert failed.status == FAILED and json.loads(failed.body)["category"] == "user"
        assert "trainer.tinker.max_request_s" in json.loads(failed.body)["error"]
        assert not worker.step()  # answered: nothing is left queued
    finally:
        worker.close()
    assert not worker.sampling.process.is_alive()


def test_a_models_unload_waits_for_its_queued_requests_and_answers_the_stranded(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """An unload (a session finished) is in the model's lane: the requests accepted before it are applied first,
    never beside it; one that waited behind a number that never came fails, saying why, not pending for ever."""
    store = _store(redis_client, "unload", tmp_path)
    _queue(store)
    optim = store.requests.op(MODEL, 2)
    # number 3 never comes
    stranded = store.requests.submit("forward_backward", _forward_backward(4), MODEL, seq=4)
    store.requests.submit("unload_model", b"", model_id=MODEL)
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    while worker.step():
        pass
    assert store.requests.result(optim).status == DONE and store.models.progress(MODEL)[0] == 2
    assert not store.models.is_loaded(MODEL) and MODEL not in worker.requests.models
    failed = store.requests.result(stranded)
    assert failed.status == FAILED and "was unloaded" in json.loads(failed.body)["error"]


def test_the_unnamed_weights_of_a_sampling_client_go_once_no_sample_used_them(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """save_weights_and_get_sampling_client saves weights under no name (an RL loop: one per step): not listed,
    each sample from them starts ``ephemeral_weights_ttl_s`` again, and past it the sweeper deletes them."""
    store = _store(redis_client, "ephemeral", tmp_path, ephemeral_weights_ttl_s=60)
    session = store.sessions.create({})
    model = f"{session}:train:0"
    store.models.add(model, {"base_model": "tiny-byte-lm", "lora": {}, "session": session})
    store.requests.submit("create_model", b"", model, seq=0)
    saved = store.requests.submit("save_weights_for_sampler", b"{}", model, seq=1)
    worker = Worker(store, redis_client, _config(ephemeral_weights_ttl_s=60), torch.device("cpu"))
    expiry, member = "ta:ephemeral:tinker:checkpoint_expiry", f"{model} sampler_weights/ephemeral-1"

    def sample() -> str:
        body = {
            "sampling_session_id": answer["sampling_session_id"],
            "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [256, 104, 105]}]},
            "sampling_params": {"max_tokens": 2},
        }
        request_id = store.requests.submit(
            "sample", json.dumps(body).encode(), lane=sampler_lane("tiny-byte-lm", path)
        )
        while worker.step():
            pass
        return request_id

    try:
        while worker.step():
            pass
        answer = json.loads(store.requests.result(saved).body)
        path = answer["path"]
        file = store.files.file_of(path)
        assert file.exists() and store.runs.checkpoints(model) == {}  # kept, not listed
        first = redis_client.zscore(expiry, member)
        assert first is not None and first == pytest.approx(time.time() + 60, abs=10)
        time.sleep(0.01)
        assert store.requests.result(sample()).status == DONE
        assert redis_client.zscore(expiry, member) > first  # the sample started the time again

        redis_client.zadd(expiry, {member: time.time() - 1})  # as if unused for the whole time
        worker.checkpoints.expire()
        assert not file.exists() and not file.with_suffix(".json").exists()
        assert redis_client.zscore(expiry, member) is None
        failed = store.requests.result(sample())
        assert failed.status == FAILED and "unused for 60 s" in json.loads(failed.body)["error"]
    finally:
        worker.close()


def test_a_stable_reinforce_accumulation_is_replayed_after_a_restart_from_the_samplers_record(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Gradients accumulated since the last snapshot are replayed by a restarted worker; a stable_reinforce one
    looks its provenance up again (the record is in Redis) and accumulates the same gradients."""
    store = _store(redis_client, "replay-sr", tmp_path)
    session = store.sessions.create({})
    model, sampler = f"{session}:train:0", f"{session}:sample:0"
    store.models.add(model, {"base_model": "tiny-byte-lm", "lora": {}, "session": session})
    store.samplers.add(sampler, "tiny-byte-lm", None)
    store.requests.submit("create_model", b"", model, seq=0)
    prompt = [256, 104, 105]
    body = {
        "sampling_session_id": sampler,
        "prompt": {"chunks": [{"tokens": prompt}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 6, "seed": 1},
        "record_stability_info": True,
    }
    sample = store.requests.submit(
        "sample", json.dumps(body).encode(), lane=sampler_lane("tiny-byte-lm", None)
    )
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    try:
        while worker.step():
            pass
    finally:
        worker.close()
    tokens = wire.read_sample_response(store.requests.result(sample).body)[0][0].tolist()
    sequence = f"{sample}:0"
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(prompt[1:] + tokens, np.int64),
            "advantages": np.ones(len(prompt) - 1 + len(tokens), np.float32),
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sequence, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sequence, length=len(tokens)),
        ],
    )
    request = types.ForwardBackwardRequest(
        types.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce"), model, 1
    )
    store.requests.submit(
        "forward_backward", forward_backward_request_to_proto(request).SerializeToString(), model, seq=1
    )
    worker = Worker(store, redis_client, _config(), torch.device("cpu"))
    worker.recover()
    while worker.step():
        pass
    grads = [
        p.grad.clone() for p in worker.requests.models[model].core.model.parameters() if p.grad is not None
    ]
    assert grads and store.models.progress(model)[0] == 1

    restarted = Worker(store, redis_client, _config(), torch.device("cpu"))
    restarted.recover()  # the accumulation since the snapshot of create_model, replayed
    again = [p.grad for p in restarted.requests.models[model].core.model.parameters() if p.grad is not None]
    assert len(again) == len(grads) and all(torch.equal(a, b) for a, b in zip(again, grads, strict=True))

    assert redis_client.delete(f"ta:replay-sr:tinker:sequence:{sequence}") == 1  # expired (a day unused)
    late = Worker(store, redis_client, _config(), torch.device("cpu"))
    late.recover()  # the model comes back without those gradients, and the worker serves on
    assert model in late.requests.models and store.models.progress(model)[0] == 1
    assert all(
        p.grad is None or not p.grad.any() for p in late.requests.models[model].core.model.parameters()
    )


def test_a_worker_whose_run_folder_another_up_took_over_writes_no_snapshot_and_stops(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started by an `up` (``TA_RUN_LOCK``): once another `up` holds the run folder, the next state-changing request
    is neither snapshotted nor recorded as applied (it stays queued, for the run that owns the folder), and the
    worker's loop stops with RunFolderInUse, as the trainer's checkpointer does."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = Holder("the-up-that-started-it", "up", 1, "host", "2025-01-01T00:00:00+0000", "owner")
    (run_dir / LOCK_NAME).write_text(json.dumps(asdict(holder)))
    monkeypatch.setenv(OWNER_VARIABLE, holder.id)
    store = _store(redis_client, "owned", run_dir / "tinker")
    _queue(store)
    worker = Worker(
        store, redis_client, _config(), torch.device("cpu"), RunFolderOwner(run_dir, "trainer", "owned")
    )
    worker.step(), worker.step()  # created (snapshotted), gradients accumulated
    assert store.models.progress(MODEL)[:2] == (1, 0)

    taken_over = Holder("another-up", "up", 2, "host", "2025-01-02T00:00:00+0000", "owner")
    (run_dir / LOCK_NAME).write_text(json.dumps(asdict(taken_over)))
    with pytest.raises(RunFolderInUse, match="not writing there"):
        worker.run(threading.Event())
    worker.close()
    assert store.models.progress(MODEL)[:2] == (
        1,
        0,
    )  # the optim_step not recorded, its number still to apply
    assert [p.name for p in run_dir.glob("tinker/*/state-*.pt")] == ["state-000000000.pt"]
