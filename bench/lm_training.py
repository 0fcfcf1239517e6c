"""Training throughput of many LoRA clients of one base: trained tokens per second, in all, of 8 rank-8 LoRA clients
of SmolLM2-135M each looping ``forward_backward`` (4 x 64 tokens of cross-entropy) + ``optim_step`` through the
tinker SDK at once, and of one such client alone, with the worker's batched passes on (``trainer.tinker.
batch_models``: the ready requests of every adapter in one forward and one backward) and off (each model in its own
lane, as before), one trainer per setting in the same run (the floor: 8 clients >= 1.5 x the lanes' throughput; one
client within the noise).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.tinker_server import ADAM, serving
from tinker_atropos.models import smollm2

KEY = "tml-bench-lm-training-0123456789"
SEQUENCES, LENGTH = 4, 64  # each forward_backward's data


def _data(rng: np.random.Generator) -> list:
    from tinker import types

    data = []
    for _ in range(SEQUENCES):
        tokens = rng.integers(0, 49152, size=LENGTH + 1)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={"target_tokens": tokens[1:]},
            )
        )
    return data


def _loop(client: object, data: list, rounds: int) -> None:
    from tinker import types

    for _ in range(rounds):
        backward, step = (
            client.forward_backward(data, "cross_entropy"),
            client.optim_step(types.AdamParams(**ADAM)),
        )
        backward.result(timeout=600), step.result(timeout=600)


def _tokens_per_s(clients: list, data: list, rounds: int) -> float:
    """Trained tokens per second of ``clients`` looping at once, ``rounds`` each (after one round each, not timed)."""
    for setup in [threading.Thread(target=_loop, args=(c, d, 1)) for c, d in zip(clients, data, strict=True)]:
        setup.start()
        setup.join()
    threads = [
        threading.Thread(target=_loop, args=(c, d, rounds)) for c, d in zip(clients, data, strict=True)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(clients) * rounds * SEQUENCES * LENGTH / (time.perf_counter() - start)


def through_api(work: Path, batch_models: bool, clients: int = 8, rounds: int = 3) -> dict:
    """A trainer serving only the Tinker API, ``batch_models`` as given: one client's tokens/s alone, then all
    ``clients``' at once."""
    import tinker

    settings = {"max_models": clients, "batch_models": batch_models}
    with serving(work, settings, key=KEY) as served:
        service = tinker.ServiceClient(base_url=served.url, api_key=KEY)
        made = [
            service.create_lora_training_client(base_model=smollm2.NAME, rank=8).result(timeout=300)
            for _ in range(clients)
        ]
        rng = np.random.default_rng(0)
        data = [_data(rng) for _ in made]
        one = _tokens_per_s(made[:1], data[:1], rounds)
        many = _tokens_per_s(made, data, rounds)
        service.close("success").result(timeout=60)
    return {
        "batch_models": batch_models,
        "clients": clients,
        "rounds": rounds,
        "one_client_tokens_per_s": one,
        "clients_tokens_per_s": many,
    }


def run(work: Path, clients: int = 8, rounds: int = 3) -> dict:
    """Batched passes off, then on; the ratios the issue's floors read."""
    if not smollm2.available():
        return {}
    off = through_api(work / "lanes", False, clients, rounds)
    on = through_api(work / "batched", True, clients, rounds)
    return {
        "lanes": off,
        "batched": on,
        "torch_threads": 1,
        "cpus": os.cpu_count(),
        "batched_vs_lanes": on["clients_tokens_per_s"] / off["clients_tokens_per_s"],
        "one_client_batched_vs_lanes": on["one_client_tokens_per_s"] / off["one_client_tokens_per_s"],
        "clients_vs_one_batched": on["clients_tokens_per_s"] / on["one_client_tokens_per_s"],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/out/lm-training"))))
