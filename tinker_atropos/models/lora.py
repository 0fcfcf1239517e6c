"""LoRA: a frozen Linear plus a low-rank update, ``base(x) + (alpha / rank) * x A^T B^T`` (PEFT's maths; its names
in ``hf_export``). B starts at zero, so wrapping a layer leaves its output unchanged; A starts small and random, so
B's gradient is not zero.

One base serves many adapters at once: inside ``rows(...)`` a batch whose rows belong to different models runs
through one module tree, the base's matmul shared by every row and each row's low-rank update taken from its own
model's adapter (found by the layer's module path), as S-LoRA and Punica batch adapters over one base. Gradients
reach each model's own adapter only; rows of the base itself (no adapter) get no update.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``base`` frozen, plus its own adapter of ``rank`` (none with rank 0: a layer of a tree that only ever runs
    rows of other models' adapters). ``path`` names the layer within its model: the same in every model of a base."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None, path: str = ""
    ) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.path = path
        self.scale = alpha / rank if rank else 0.0
        bound = 1 / math.sqrt(base.in_features)  # nn.Linear's (and PEFT's) init range for A
        a = torch.empty(rank, base.in_features, device=base.weight.device)
        self.lora_a = nn.Parameter(a.uniform_(-bound, bound, generator=generator))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * x A^T B^T``, in the adapter's float32 whatever the base's dtype, returned in ``x``'s."""
        # scaled at rank width: a pass over the output (an unembedding's: the vocabulary's width) saved
        return ((self.scale * (x.to(self.lora_a.dtype) @ self.lora_a.T)) @ self.lora_b.T).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        segments = _ROWS.get()
        if segments is None:
            return self.base(x) + self.update(x) if self.scale else self.base(x)
        y = self.base(x)
        if len(segments) == 1:  # one model's rows (one client's batch): no split, no join
            layer = segments[0][1].get(self.path) if segments[0][1] is not None else None
            return y + layer.update(x) if layer is not None and layer.scale else y
        # each segment's rows plus its update, joined. Split, not sliced: the backward of each slice would write a
        # zero gradient of the whole output (and an in-place add into the rows would copy it, CopySlices) per segment
        counts = [count for count, _ in segments]
        parts, updated = [], False
        for rows, inputs, (_, adapter) in zip(y.split(counts), x.split(counts), segments, strict=True):
            layer = adapter.get(self.path) if adapter is not None else None
            if layer is not None and layer.scale:
                rows = rows + layer.update(inputs)
                updated = True
            parts.append(rows)
        return torch.cat(parts) if updated else y


Adapter = Mapping[str, LoRALinear]  # a model's LoRA layers by module path
_ROWS: contextvars.ContextVar[Sequence[tuple[int, Adapter | None]] | None] = contextvars.ContextVar(
    "lora_rows", default=None
)


@contextlib.contextmanager
def rows(segments: Sequence[tuple[int, Adapter | None]]) -> Iterator[None]:
    """Within it, every ``LoRALinear`` takes a batch's rows in ``segments`` order: ``count`` rows of the model
    whose ``adapter`` it is (None: the base alone); the counts add up to the batch's first dimension."""
    token = _ROWS.set(_merged(segments))
    try:
        yield
    finally:
        _ROWS.reset(token)


def _merged(segments: Sequence[tuple[int, Adapter | None]]) -> list[tuple[int, Adapter | None]]:
    """Neighbouring segments of one adapter as one: a batch of a client's 32 one-sample requests then takes one
    low-rank update per layer, not 32 (that was half of a decoding step's time)."""
    merged: list[tuple[int, Adapter | None]] = []
    for count, adapter in segments:
        if merged and (merged[-1][1] is adapter or merged[-1][1] == adapter):
            merged[-1] = (merged[-1][0] + count, adapter)
        else:
            merged.append((count, adapter))
    return merged


def adapter(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA-wrapped Linear of ``model`` by its module path (PEFT's ``target_modules`` names them so)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def wrap(
    model: nn.Module,
    targets: Sequence[tuple[nn.Module, str]],
    rank: int,
    *,
    alpha: float | None = None,
    seed: int | None = None,
    allow_rank_zero: bool = False,
) -> list[nn.Parameter]:
    """Wrap each ``(parent, attribute)`` Linear of ``model`` in ``LoRALinear`` and freeze every base parameter; the
    adapters' parameters (what the optimiser steps).

    ``alpha`` defaults to 32 whatever the rank, Tinker's convention: with the alpha/rank scale the good learning
    rate barely depends on the rank. ``seed`` fixes A's init; None draws it from the global torch RNG. The same
    arguments on a fresh model give the same parameter names, so ``load_state_dict`` restores a LoRA model.
    ``allow_rank_zero``: layers without an adapter of their own, for a tree that serves other models' rows."""
    if rank < 1 and not (allow_rank_zero and rank == 0):
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA adapters")
    alpha = 32.0 if alpha is None else alpha
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    paths = {id(module): name for name, module in model.named_modules()}
    model.requires_grad_(False)
    params: list[nn.Parameter] = []
    for parent, name in targets:
        path = f"{paths[id(parent)]}.{name}".lstrip(".")
        layer = LoRALinear(getattr(parent, name), rank, alpha, generator, path)
        setattr(parent, name, layer)
        if rank:
            params += [layer.lora_a, layer.lora_b]
        else:
            layer.requires_grad_(False)
    return params
