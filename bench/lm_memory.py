"""Trainer memory per LoRA client of one base: the resident set (``VmRSS``) of a process holding N rank-8 LoRA
models of SmolLM2-135M, each having taken one ``forward_backward`` (4 x 64 tokens of cross-entropy) and one
``optim_step`` through the non-finite guard, as the Tinker worker runs them. Each N in a fresh process (``python -m
bench.lm_memory N``), so one count's memory is not another's. Every LoRA model of a base shares its frozen weights
(DESIGN.md §6): a client should cost its adapter, its optimizer moments and its activations, not a copy of the base.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from bench.tinker_server import ADAM, serving
from tinker_atropos.config import parse_config
from tinker_atropos.models import smollm2
from tinker_atropos.tinker_api import base_models
from tinker_atropos.tinker_api.engine.handlers import adam_params
from tinker_atropos.training.data import Datum
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import owned_bytes, run_loss


def rss_mb(pid: int | str = "self") -> float:
    """The resident set of a process, MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmRSS")


def measure(clients: int, rank: int = 8) -> dict:
    """In this process: ``clients`` LoRA models of SmolLM2, one step each; the RSS before any and after all."""
    torch.set_num_threads(1)
    config = parse_config({"run": {"name": "bench-memory"}})
    rng = np.random.default_rng(0)
    before = rss_mb()
    models, guard, adam = [], NonfiniteGuard(), adam_params(ADAM)
    for i in range(clients):
        model = base_models.build(smollm2.NAME, {"rank": rank}, config.trainer.model, torch.device("cpu"), i)
        data = []
        for _ in range(4):
            tokens = rng.integers(0, 49152, size=65)
            data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(64, np.float32)}))
        run_loss(model, data, "cross_entropy", {}, forward_only=False)
        guard.update(model.core, None, lambda m=model: m.core.optim_step(adam))
        models.append(model)
    owned = sum(owned_bytes(m) for m in models) / 1e6  # adapters, their gradients and moments, at most
    return {"clients": clients, "rank": rank, "rss_before_mb": before, "rss_mb": rss_mb(), "owned_mb": owned}


def through_api(work: Path, clients: int = 8, rank: int = 8) -> list[dict]:
    """The trainer's RSS through the Tinker API: a trainer serving only it, ``clients`` SDK clients of SmolLM2
    created one after the other, each taking one ``forward_backward`` + ``optim_step``; a row after each."""
    import tinker
    from tinker import types

    rows, rng = [{"clients": 0}], np.random.default_rng(0)
    with serving(work, {"max_models": clients}) as served:
        rows[0]["rss_mb"] = rss_mb(served.pid)
        service = tinker.ServiceClient(base_url=served.url, api_key=served.key)
        for n in range(1, clients + 1):
            client = service.create_lora_training_client(base_model=smollm2.NAME, rank=rank).result(
                timeout=300
            )
            data = []
            for _ in range(4):
                tokens = rng.integers(0, 49152, size=65)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": tokens[1:]},
                    )
                )
            backward, step = (
                client.forward_backward(data, "cross_entropy"),
                client.optim_step(types.AdamParams(**ADAM)),
            )
            backward.result(timeout=300), step.result(timeout=300)
            rows.append({"clients": n, "rss_mb": rss_mb(served.pid)})
        service.close("success").result(timeout=60)
    return rows


def run(counts: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Each count in a fresh process; the rows, with the cost per client beyond the first."""
    rows = []
    for n in counts:
        out = subprocess.run(
            [sys.executable, "-m", "bench.lm_memory", str(n)], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one = next((r["rss_mb"] for r in rows if r["clients"] == 1), None)
    for row in rows:
        if one is not None and row["clients"] > 1:
            row["per_extra_client_mb"] = (row["rss_mb"] - one) / (row["clients"] - 1)
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
