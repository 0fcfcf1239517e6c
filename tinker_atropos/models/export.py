"""A run's acting policy as one file that other programs load without this package: ONNX, or torch.export's
``.pt2`` (the successor of TorchScript, which torch 2.13 deprecates).

What is exported is the deterministic policy (the distribution's mode, as ``eval`` acts) with the observation
normaliser folded in: raw observations in (a batch of the env's flat observations), env actions out. A robot
controller or a game engine runs it with ONNX Runtime, or torch (``torch.export.load``, or AOTInductor for C++),
and nothing of ours.

An ONNX file holds its weights inline, so that it is the one file to copy; only a network too big for one
Protobuf message (2 GiB, far above any policy here) gets them in a ``.data`` file beside it, and the caller is
told of both files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from tinker_atropos.models.mlp import ActorCritic

FORMATS = ("onnx", "pt2")
Format = Literal["onnx", "pt2"]
INLINE_LIMIT_BYTES = 1 << 30  # weights above this go beside the .onnx (Protobuf caps a message at 2 GiB)
# what torch's ONNX exporter imports, which the ``export`` extra installs
ONNX_EXPORTER = ("onnx", "onnxscript")


class MissingExtra(ImportError):
    """A format whose writer is an optional dependency that is not installed; the message names the extra."""


class ModePolicy(nn.Module):
    """Raw observations to the policy's most likely env actions."""

    def __init__(self, model: ActorCritic) -> None:
        super().__init__()
        self.model = model.eval()

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        return self.model.mode(self.model.normalize_obs(observations))


@contextlib.contextmanager
def _exporters_quiet() -> Iterator[None]:
    """Silence what torch's exporters say of themselves, not of the policy: the ONNX exporter's note that
    torchvision's operators are not registered (no policy uses them), and a deprecation inside torch's pytree."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
            yield
    finally:
        registration.setLevel(level)


def export_policy(model: ActorCritic, path: Path, fmt: Format) -> list[Path]:
    """Write ``model``'s deterministic policy to ``path`` in ``fmt`` (its folder made if missing); any batch size
    is accepted. Every file written, ``path`` first."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {', '.join(FORMATS)}")
    # else torch's exporter fails on its first import, 60 lines deep
    if fmt == "onnx" and (missing := [n for n in ONNX_EXPORTER if importlib.util.find_spec(n) is None]):
        raise MissingExtra(
            f"the ONNX exporter needs {' and '.join(missing)}: pip install 'tinker-atropos[export]'",
            name=missing[0],
        )
    if not path.parent.is_dir():  # a file where the folder would be: mkdir's "File exists" would mislead
        path.parent.mkdir(parents=True)
    policy = ModePolicy(model).eval()
    example = torch.zeros((2, *model.spec["obs_shape"]), dtype=torch.float32)
    batch = {"observations": {0: torch.export.Dim("batch")}}
    weights_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    external = fmt == "onnx" and weights_bytes > INLINE_LIMIT_BYTES
    data = path.with_name(path.name + ".data")  # where torch's exporter puts external weights
    with torch.no_grad(), _exporters_quiet():
        if fmt == "pt2":
            torch.export.save(torch.export.export(policy, (example,), dynamic_shapes=batch), str(path))
        else:
            data.unlink(missing_ok=True)  # an older export's: the new file does not use it
            torch.onnx.export(
                policy,
                (example,),
                str(path),
                input_names=["observations"],
                output_names=["actions"],
                dynamic_shapes=batch,
                dynamo=True,
                external_data=external,
                verbose=False,
            )
    return [path, data] if external and data.exists() else [path]
