"""Which LoRA implementation the trainer uses, decided by measurement: our ``LoRALinear`` against PEFT's
``LoraModel`` on SmolLM2-135M, the same targets (attention, MLP, unembedding), rank, alpha and data, one torch
thread, alternating, median of ``ROUNDS``:

- one adapter: a ``forward_backward`` of 4 x 64 tokens of cross-entropy plus an AdamW step, its time and the
  adapter's parameters;
- eight adapters of one base: ours in one pass (``lora.rows``: each row through its own adapter, the base's
  matmuls shared), PEFT one pass per adapter (``set_adapter``), since PEFT's mixed-adapter batches
  (``adapter_names``) are for inference only and refuse a model in training mode.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tinker_atropos.models import lora, smollm2
from tinker_atropos.training.served import own_copy

RANK, ALPHA, ADAPTERS, SEQUENCES, LENGTH, ROUNDS = 8, 32.0, 8, 4, 64, 5


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 49152, (SEQUENCES, LENGTH + 1), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def ours(adapters: int) -> tuple[Callable[[], None], int]:
    """``adapters`` LoRA models over one frozen SmolLM2, each with its own AdamW; one step: every adapter's
    ``forward_backward`` in one batched pass, then each optimizer's step."""
    base = smollm2.load()
    models, optimizers = [], []
    for seed in range(adapters):
        model = own_copy(base, share=True)  # the base's tensors, a tree of its own
        params = lora.wrap(model, smollm2.lora_targets(model, True, True, True), RANK, alpha=ALPHA, seed=seed)
        models.append(model)
        optimizers.append(torch.optim.AdamW(params, lr=1e-4))
    batches = [_batch(seed) for seed in range(adapters)]
    tokens = torch.cat([batch[:, :-1] for batch in batches])

    def step() -> None:
        with lora.rows([(SEQUENCES, lora.adapter(model)) for model in models]):
            logits = models[0](tokens)
        losses = [_loss(part, batch) for part, batch in zip(logits.split(SEQUENCES), batches, strict=True)]
        torch.stack(losses).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    return step, sum(p.numel() for p in optimizers[0].param_groups[0]["params"])


def peft(adapters: int) -> tuple[Callable[[], None], int]:
    """The same adapters as PEFT ``LoraModel`` adapters of one model; one step: each adapter's pass in turn."""
    from peft import LoraConfig, get_peft_model

    hf = smollm2.build().hf
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=names, lora_dropout=0.0)
    with warnings.catch_warnings():  # the tied unembedding adapted: harmless here, PEFT warns
        warnings.simplefilter("ignore")
        model = get_peft_model(hf, config, adapter_name="a0")
        for i in range(1, adapters):
            model.add_adapter(f"a{i}", config)
    optimizers = []
    for i in range(adapters):
        params = [p for n, p in model.named_parameters() if f".a{i}." in n]
        optimizers.append(torch.optim.AdamW(params, lr=1e-4))
    batches = [_batch(seed) for seed in range(adapters)]

    def step() -> None:
        for i, (optimizer, batch) in enumerate(zip(optimizers, batches, strict=True)):
            model.base_model.set_adapter(f"a{i}")
            _loss(model(input_ids=batch[:, :-1]).logits, batch).backward()
            optimizer.step()
            optimizer.zero_grad()

    return step, sum(p.numel() for p in optimizers[0].param_groups[0]["params"])


def run(out: Path | None = None) -> dict[str, Any]:
    """Both implementations at 1 and ``ADAPTERS`` adapters: trained tokens/s, the ratio ours / PEFT."""
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": RANK, "tokens_per_adapter": SEQUENCES * LENGTH, "torch_threads": 1}
    for adapters in (1, ADAPTERS):
        steps = {"ours": ours(adapters), "peft": peft(adapters)}
        for step, _ in steps.values():
            step()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(ROUNDS):
            for name, (step, _) in steps.items():
                times[name].append(_timed(step))
        tokens = adapters * SEQUENCES * LENGTH
        row = {name: tokens / statistics.median(elapsed) for name, elapsed in times.items()}
        row["adapter_parameters"] = {name: count for name, (_, count) in steps.items()}
        row["ours_vs_peft"] = row["ours"] / row["peft"]
        result[f"{adapters}_adapters_tokens_per_s"] = row
    if out is not None:
        out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]) if len(sys.argv) > 1 else None), indent=2))
