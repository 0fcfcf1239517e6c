"""Tenants share the Tinker API's sampling: one client keeping 200 long samples queued does not hold another
client's short sample (it joins the next batch), a session's queue is bounded (429 naming the setting), and a
client killed mid-flood has its queued and running samples cancelled once its session expires."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
import tinker
from tinker import types

from tests.support.processes import wait_for
from tests.support.tinker_server import KEY, Raw, serving
from tinker_atropos.state import keys
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

LM = "tiny-byte-lm"
FLOOD, MAX_QUEUED = 200, 200
# a client flooding the sampler: 200 samples of 4 x 500 tokens that never stop early, then it waits to be killed
FLOODER = textwrap.dedent("""
    import sys, time, tinker
    from tinker import types
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    sampler = service.create_sampling_client(base_model=sys.argv[3]).result(timeout=60)
    params = types.SamplingParams(max_tokens=500, stop=[], temperature=1.0)
    prompt = types.ModelInput.from_ints([1, 70, 108, 111, 111, 100])
    futures = [sampler.sample(prompt, num_samples=4, sampling_params=params) for _ in range(int(sys.argv[4]))]
    print(sampler._sampling_session_id, flush=True)
    time.sleep(3600)
""")


def test_a_flooding_client_neither_holds_another_clients_sample_nor_outlives_its_session(
    valkey: EmbeddedValkey, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = "tk-fair"
    with serving(tmp_path, valkey.url, run, session_timeout_s=15, max_queued_requests=MAX_QUEUED) as trainer:
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, trainer.url, KEY, LM, str(FLOOD)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flooder.stdout is not None
            sampler_id = flooder.stdout.readline().strip()
            session = sampler_id.split(":")[0]
            queue = f"{keys.tinker(run)}:queue:tenant:{session}"
            wait_for(lambda: redis_client.llen(queue) == FLOOD, 60, "the flood queued")

            raw = Raw(trainer.url)  # one more of the flooder's samples: past its bound
            body = types.SampleRequest(
                sampling_session_id=sampler_id,
                prompt=types.ModelInput.from_ints([1, 2]),
                num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=4),
            )
            refused = raw.client.post("/api/v1/asample", json=body.model_dump(mode="json", exclude_none=True))
            raw.close()
            assert refused.status_code == 429, refused.text
            assert "trainer.tinker.max_queued_requests" in refused.json()["detail"]

            newcomer = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
            sampler = newcomer.create_sampling_client(base_model=LM).result(timeout=60)
            waits = []
            for _ in range(5):
                started = time.monotonic()
                sample = sampler.sample(
                    types.ModelInput.from_ints([1, 104, 105]),
                    num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=8, stop=[]),
                ).result(timeout=120)
                waits.append(time.monotonic() - started)
                assert len(sample.sequences[0].tokens) == 8
            # answered while the flood still waits: not after it
            assert redis_client.llen(queue) >= FLOOD - 100, redis_client.llen(queue)
        finally:
            flooder.kill()  # SIGKILL: its session stops heart-beating
            flooder.wait(timeout=10)
        killed = time.monotonic()
        started = time.monotonic()
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=8)).result(
            timeout=60
        )
        fresh_s = time.monotonic() - started
        # its session expires (15 s without a heartbeat): its queued samples are failed, its running ones leave
        wait_for(lambda: redis_client.llen(queue) == 0, 60, "the killed flooder's samples cancelled")
        cancelled_s = time.monotonic() - killed
        wait_for(lambda: f"{session} ended: " in trainer.log(), 10, "the cancellation logged")
        cancelled = re.search(r"(\d+) queued samples cancelled, its running ones too", trainer.log())
        assert cancelled is not None and int(cancelled[1]) > 0, trainer.log()[-2000:]
        newcomer.close("success").result(timeout=30)
        print(
            f"newcomer's 8-token samples during the flood: {', '.join(f'{w:.2f}' for w in waits)} s; "
            f"a fresh sample after the SIGKILL {fresh_s:.2f} s; the flood cancelled {cancelled_s:.1f} s after it"
        )


def _threads(pid: int) -> int:
    return int(
        next(
            line
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Threads:")
        ).split()[1]
    )


def test_the_sampling_process_keeps_engines_only_for_the_samplers_it_keeps(
    valkey: EmbeddedValkey, tmp_path: Path
) -> None:
    """A full fine-tune saving a sampler at every step: each sampler has a batch of its own weights, whose engine
    (a thread and a model copy) goes once ``max_samplers`` newer ones are kept."""
    with serving(tmp_path, valkey.url, "tk-engines", max_samplers=2) as trainer:
        service = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
        training = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
        )
        threads = []
        for _ in range(6):
            training.forward_backward([datum], "cross_entropy").result(timeout=60)
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
            sampler = training.save_weights_and_get_sampling_client().result(timeout=60)
            params = types.SamplingParams(max_tokens=4)
            sampler.sample(types.ModelInput.from_ints([1, 2]), 1, params).result(timeout=60)
            assert trainer.process is not None
            tasks = Path(f"/proc/{trainer.process.pid}/task").glob("*/children")  # started by any thread
            children = [int(pid) for task in tasks for pid in task.read_text().split()]
            sampling = [pid for pid in children if b"spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(sampling) == 1, children
            threads.append(_threads(sampling[0]))
        service.close("success").result(timeout=30)
    # the same threads after 6 samplers as after 3 (on c22db17: one more engine thread a step)
    assert max(threads[3:]) <= threads[2] + 1, threads
    print(f"the sampling process's threads after each of 6 samplers (max_samplers 2): {threads}")


def test_a_models_queue_of_training_requests_is_bounded_and_a_429_is_asked_again_not_refused(
    valkey: EmbeddedValkey, tmp_path: Path
) -> None:
    with serving(tmp_path, valkey.url, "tk-train-queue", max_queued_requests=2) as trainer:
        service = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
        model_id = service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60).model_id
        raw, adam = Raw(trainer.url), types.AdamParams(learning_rate=1e-3)
        try:
            ahead = raw.client.post(
                "/api/v1/optim_step",
                json=types.OptimStepRequest(optim_params=adam, model_id=model_id, seq_id=3).model_dump(
                    mode="json", exclude_none=True
                ),
            )
            assert ahead.status_code == 429, ahead.text
            assert "trainer.tinker.max_queued_requests" in ahead.json()["detail"]
            for seq in (1, 2, 3):  # in turn: number 3 asked again once 1 is applied, and applied, not refused
                done = raw.result(raw.optim_step(model_id, seq, adam)).json()
                assert "error" not in done, done
        finally:
            raw.close()
            service.close("success").result(timeout=30)
