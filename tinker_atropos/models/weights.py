"""Published weights as bytes: a state dict saved by torch, loaded only as tensors (``weights_only``) and checked
finite, since whatever comes back from Redis is untrusted."""

from __future__ import annotations

import io
from collections.abc import Mapping

import torch
from torch import nn


def weights_to_bytes(model: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def nonfinite_entries(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of a state dict that hold a NaN or an infinity."""
    return [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def weights_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Published weights, checked: ValueError for a blob that is not a state dict or holds non-finite values
    (one NaN in them and every action of every rollout is NaN)."""
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling, zip or format errors: a blob we did not write
        raise ValueError(f"weights that do not load: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError("weights that are not a state dict of tensors")
    odd = [name for name, t in state.items() if t.layout != torch.strided or t.device.type != "cpu"]
    if odd:  # sparse or meta tensors, which torch.load also makes: nothing a model of ours holds
        raise ValueError(
            f"weights with tensors that are not dense CPU tensors: {', '.join(map(str, odd[:5]))}"
        )
    try:
        bad = nonfinite_entries(state)
    except RuntimeError as error:  # a dtype without a finite check (float8): not a state dict of ours
        raise ValueError(f"weights that cannot be checked: {error}") from None
    if bad:
        raise ValueError(f"weights with NaN or infinity in {', '.join(map(str, bad))}")
    return state
