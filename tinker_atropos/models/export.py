"""A run's acting policy as one file that other programs load without this package: ONNX, or torch.export's
``.pt2`` (the successor of TorchScript, which torch 2.13 deprecates).

What is exported is the deterministic policy (the distribution's mode, as ``eval`` acts) with the observation
normaliser folded in: raw observations in (a batch of the env's flat observations), env actions out. A robot
controller or a game engine runs it with ONNX Runtime, or torch (``torch.export.load``, or AOTInductor for C++),
and nothing of ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from tinker_atropos.models.mlp import ActorCritic

FORMATS = ("onnx", "pt2")
Format = Literal["onnx", "pt2"]


class ModePolicy(nn.Module):
    """Raw observations to the policy's most likely env actions."""

    def __init__(self, model: ActorCritic) -> None:
        super().__init__()
        self.model = model.eval()

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        return self.model.mode(self.model.normalize_obs(observations))


def export_policy(model: ActorCritic, path: Path, fmt: Format) -> Path:
    """Write ``model``'s deterministic policy to ``path`` in ``fmt``; any batch size is accepted."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {', '.join(FORMATS)}")
    policy = ModePolicy(model)
    example = torch.zeros((2, *model.spec["obs_shape"]), dtype=torch.float32)
    batch = {"observations": {0: torch.export.Dim("batch")}}
    with torch.no_grad():
        if fmt == "pt2":
            torch.export.save(torch.export.export(policy, (example,), dynamic_shapes=batch), str(path))
        else:
            torch.onnx.export(
                policy,
                (example,),
                str(path),
                input_names=["observations"],
                output_names=["actions"],
                dynamic_shapes=batch,
                dynamo=True,
                verbose=False,
            )
    return path
