"""Latency of one ``forward_backward`` + ``optim_step`` round trip through the tinker SDK against our trainer's
Tinker API, beside the same update called in-process on the same model code, for the Humanoid control policy
(a 512-step PPO minibatch) and the tiny LM (4 x 64 tokens of cross-entropy). The overhead is what the API adds:
the SDK's serialisation, HTTP, the request and result kept in Redis, the snapshot after each step, the long poll.
Then the sampler's tokens per second against Hugging Face ``generate`` (``bench/tinker_sampling.py``), and the
trainer's memory with 1 to 8 LoRA clients of SmolLM2 (``bench/lm_memory.py``), and their trained tokens per second
with the worker's batched passes on and off (``bench/lm_training.py``), many clients sampling SmolLM2 at once
(``bench/lm_sampling.py``), and our LoRA layer against PEFT's (``bench/lora_impl.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench import lm_memory, lm_sampling, lm_training, lora_impl, tinker_sampling
from bench.tinker_server import ADAM as TINKER_ADAM
from bench.tinker_server import serving
from tinker_atropos.config import parse_config
from tinker_atropos.models import smollm2
from tinker_atropos.tinker_api import base_models
from tinker_atropos.tinker_api.engine.handlers import adam_params
from tinker_atropos.training.data import Datum
from tinker_atropos.training.served import TINY_LM, run_loss

KEY = "tml-bench-latency-0123456789"
ADAM = TINKER_ADAM | {"grad_clip_norm": 0.5}


@dataclass(frozen=True)
class Case:
    name: str
    base_model: str
    lora_rank: int
    loss: str
    data: list[Datum]


def cases(rng: np.random.Generator) -> list[Case]:
    def policy_datum(t: int) -> Datum:
        return Datum(
            np.zeros(t, np.int64),
            {
                "observations": rng.normal(size=(t, 348)).astype(np.float32),
                "actions": rng.normal(size=(t, 17)).astype(np.float32),
                "logprobs": rng.normal(-20, 1, size=t).astype(np.float32),
                "advantages": rng.normal(size=t).astype(np.float32),
                "returns": rng.normal(size=t).astype(np.float32),
            },
        )

    def text_datum(t: int) -> Datum:
        tokens = rng.integers(0, 256, size=t + 1)
        return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(t, np.float32)})

    return [
        Case(
            "Humanoid policy, PPO, 512 steps",
            "mlp-gaussian/Humanoid-v5",
            0,
            "ppo",
            [policy_datum(64) for _ in range(8)],
        ),
        Case(
            "tiny LM LoRA 16, cross-entropy, 4x64 tokens",
            TINY_LM,
            16,
            "cross_entropy",
            [text_datum(64) for _ in range(4)],
        ),
        Case(
            "tiny LM full, cross-entropy, 4x64 tokens",
            TINY_LM,
            0,
            "cross_entropy",
            [text_datum(64) for _ in range(4)],
        ),
    ]


def in_process(case: Case, model_section: object, iterations: int) -> list[float]:
    model = base_models.build(
        case.base_model, {"rank": case.lora_rank}, model_section, torch.device("cpu"), 1
    )
    params = adam_params(ADAM)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        run_loss(model, case.data, case.loss, {}, forward_only=False)
        model.core.optim_step(params)
        times.append(time.perf_counter() - start)
    return times


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def through_sdk(
    case: Case, base_url: str, iterations: int, server_pid: int
) -> tuple[list[float], float, float]:
    """Round-trip times, and the CPU seconds this (client) process and the trainer spent per round trip."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=case.base_model, rank=case.lora_rank).result()
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(d.tokens.tolist()), loss_fn_inputs=d.inputs)
        for d in case.data
    ]
    adam = types.AdamParams(**ADAM)
    times, cpu, server_cpu = [], time.process_time(), _cpu_s(server_pid)
    for _ in range(iterations):
        start = time.perf_counter()
        fwd, opt = client.forward_backward(data, case.loss), client.optim_step(adam)
        fwd.result(), opt.result()
        times.append(time.perf_counter() - start)
    cpu, server_cpu = (time.process_time() - cpu) / iterations, (_cpu_s(server_pid) - server_cpu) / iterations
    service.close("success").result()
    return times, cpu, server_cpu


def run(out: Path, iterations: int = 60, warmup: int = 10) -> dict:
    """Start Valkey and a trainer serving only the Tinker API, measure every case both ways, write the table."""
    out.mkdir(parents=True, exist_ok=True)
    work = out / "tinker-latency"
    model_section = parse_config({"run": {"name": "bench-tinker"}}).trainer.model
    rows = []
    with serving(work, env_id="Humanoid-v5", key=KEY) as served:
        torch.set_num_threads(1)  # as the trainer (trainer.torch_threads)
        for case in cases(np.random.default_rng(0)):
            sdk, client_cpu, server_cpu = through_sdk(case, served.url, iterations + warmup, served.pid)
            sdk = sdk[warmup:]
            local = in_process(case, model_section, iterations + warmup)[warmup:]
            row = {"case": case.name, "sdk_ms": 1000 * statistics.median(sdk)}
            row["in_process_ms"] = 1000 * statistics.median(local)
            row["sdk_p90_ms"] = 1000 * float(np.percentile(sdk, 90))
            row["sdk_client_cpu_ms"], row["trainer_cpu_ms"] = 1000 * client_cpu, 1000 * server_cpu
            rows.append(row)
    sampling = tinker_sampling.run()
    memory = lm_memory.through_api(work / "memory") if smollm2.available() else []
    concurrent = lm_sampling.run(work / "concurrent") if smollm2.available() else {}
    training = lm_training.run(work / "lm-training")
    lora_layers = lora_impl.run() if smollm2.available() else {}
    result = {"iterations": iterations, "machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows}
    result.update(torch_threads=torch.get_num_threads(), sampling=sampling, memory=memory)
    result.update(concurrent_sampling=concurrent, lm_training=training, lora_implementation=lora_layers)
    (out / "bench-tinker.json").write_text(json.dumps(result, indent=2))
    table = Table(title=f"forward_backward + optim_step round trip (median of {iterations})")
    for column in (
        "case",
        "SDK ms",
        "p90",
        "client CPU",
        "trainer CPU",
        "in-process ms",
        "overhead",
        "ratio",
    ):
        table.add_column(column)
    for row in rows:
        overhead = row["sdk_ms"] - row["in_process_ms"]
        table.add_row(
            row["case"],
            f"{row['sdk_ms']:.2f}",
            f"{row['sdk_p90_ms']:.2f}",
            f"{row['sdk_client_cpu_ms']:.2f}",
            f"{row['trainer_cpu_ms']:.2f}",
            f"{row['in_process_ms']:.2f}",
            f"{overhead:.2f}",
            f"{row['sdk_ms'] / row['in_process_ms']:.2f}",
        )
    Console().print(table)
    table = Table(
        title=f"sampling tokens/s, median of {sampling[0]['repeats'] if sampling else 0} (torch threads "
        f"{torch.get_num_threads()})"
    )
    for column in (
        "model",
        "device",
        "prompt",
        "samples x tokens",
        "ours tok/s",
        "peer",
        "peer tok/s",
        "ratio",
    ):
        table.add_column(column)
    for row in sampling:
        table.add_row(
            row["model"],
            row["device"],
            str(row["prompt_tokens"]),
            f"{row['num_samples']} x {row['max_tokens']}",
            f"{row['ours_tokens_per_s']:.1f}",
            row["peer"],
            f"{row['peer_tokens_per_s']:.1f}",
            f"{row['ratio']:.2f}",
        )
    Console().print(table)
    if (
        memory
    ):  # DESIGN.md §6: a LoRA client costs its adapter, its moments, its activations (floor: 60 MB each)
        one, last = memory[1]["rss_mb"], memory[-1]
        table = Table(
            title="trainer RSS with N rank-8 LoRA clients of SmolLM2, one step each (floor: one client's "
            f"+ 60 MB per client, {one + 60 * last['clients']:,.0f} MB at {last['clients']})"
        )
        for column in ("clients", "trainer RSS MB", "per client beyond the first MB"):
            table.add_column(column)
        for row in memory:
            extra = (row["rss_mb"] - one) / (row["clients"] - 1) if row["clients"] > 1 else float("nan")
            table.add_row(str(row["clients"]), f"{row['rss_mb']:,.0f}", f"{extra:.0f}")
        Console().print(table)
    if training:  # the floor: 8 clients batched >= 1.5 x their lanes; one client within the noise
        table = Table(
            title="trained tokens/s of rank-8 LoRA clients of SmolLM2, forward_backward (4 x 64 tokens) + "
            "optim_step through the SDK, batched passes (trainer.tinker.batch_models) on vs off"
        )
        for column in ("clients", "lanes tok/s", "batched tok/s", "batched / lanes"):
            table.add_column(column)
        off, on = training["lanes"], training["batched"]
        for label, key in (("1", "one_client_tokens_per_s"), (str(on["clients"]), "clients_tokens_per_s")):
            table.add_row(label, f"{off[key]:.0f}", f"{on[key]:.0f}", f"{on[key] / off[key]:.2f}")
        Console().print(table)
    if concurrent:  # the floor: 16 clients >= 4 x one client alone, >= 1.0 x generate's static batch
        c = lm_sampling
        table = Table(
            title=f"SmolLM2 sampling through the SDK, {c.CLIENTS} clients x {c.SAMPLES} x {c.TOKENS} tokens at once "
            f"({concurrent['torch_threads']} threads)"
        )
        for column in (
            "1 client tok/s",
            "16 clients tok/s",
            "generate, static batch",
            "16 / 1",
            "16 / generate",
        ):
            table.add_column(column)
        for column in ("TTFT p50 s", "TTFT p95 s"):
            table.add_column(column)
        engine = concurrent["engine_in_process"]
        table.add_row(
            f"{concurrent['alone']['tokens_per_s']:.1f}",
            f"{concurrent['together']['tokens_per_s']:.1f}",
            f"{concurrent['hf_static_batch']['tokens_per_s']:.1f}",
            f"{concurrent['together_vs_alone']:.2f}",
            f"{concurrent['together_vs_hf_static']:.2f}",
            f"{engine['ttft_p50_s']:.2f}",
            f"{engine['ttft_p95_s']:.2f}",
        )
        Console().print(table)
    if lora_layers:
        table = Table(
            title="our LoRA layer against PEFT's, SmolLM2 rank 8, forward_backward + AdamW, trained tok/s"
        )
        for column in ("adapters", "ours", "PEFT", "ours / PEFT"):
            table.add_column(column)
        for adapters in (1, lora_impl.ADAPTERS):
            row = lora_layers[f"{adapters}_adapters_tokens_per_s"]
            table.add_row(
                str(adapters), f"{row['ours']:.0f}", f"{row['peft']:.0f}", f"{row['ours_vs_peft']:.2f}"
            )
        Console().print(table)
    return result
