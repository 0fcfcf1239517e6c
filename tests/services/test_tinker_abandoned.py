"""The tinker SDK never closes its session when a script ends, so a client that vanished is
known only by its heartbeats stopping. Its models are unloaded within a minute, counted in the trainer's status,
and their snapshots deleted: a new client can create models up to ``max_models`` again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from tests.support.processes import wait_for
from tests.support.tinker_server import KEY, sdk_session, serving
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration

LM = "tiny-byte-lm"
# a user's script: two models, a training step on each, then it hangs until killed (its session never closed)
SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np, tinker
    from tinker import types
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": np.asarray([2, 3, 4], np.int64)})
    for _ in range(2):
        client = service.create_lora_training_client(base_model=sys.argv[3], rank=0).result(timeout=60)
        client.forward_backward([datum], "cross_entropy").result(timeout=60)
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        print(client.model_id, flush=True)
    time.sleep(3600)
""")


def test_an_abandoned_sdk_sessions_models_are_freed_within_a_minute(
    valkey: EmbeddedValkey, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with serving(tmp_path, valkey.url, "tk-abandoned", session_timeout_s=15, max_models=2) as trainer:
        script = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, trainer.url, KEY, LM], stdout=subprocess.PIPE, text=True
        )
        try:
            assert script.stdout is not None
            models = [script.stdout.readline().strip() for _ in range(2)]
            folders = [trainer.run_dir / "tinker" / model.replace(":", "_") for model in models]
            assert all(list(folder.glob("state-*.pt")) for folder in folders), models
        finally:
            script.kill()  # SIGKILL: no code of the script's runs, as when its machine goes away
            script.wait(timeout=10)
        killed = time.monotonic()
        wait_for(
            lambda: not any(folder.exists() for folder in folders), 60, "the snapshots of the killed client"
        )
        freed_s = time.monotonic() - killed
        with sdk_session(trainer) as service:  # as many models as max_models, again
            for _ in range(2):
                assert service.create_lora_training_client(base_model=LM, rank=0).result(timeout=60).model_id

        def events() -> dict[str, int]:
            records = live_services(redis_client, "tk-abandoned", "trainer")
            return records[0].figures["tinker_events"] if records else {}

        wait_for(
            lambda: events().get("models_expired") == 2, 15, "the expired models in the trainer's status"
        )
        assert events()["sessions_expired"] == 1, events()
        print(f"the killed client's 2 models freed {freed_s:.1f} s after its SIGKILL (session_timeout_s 15)")
