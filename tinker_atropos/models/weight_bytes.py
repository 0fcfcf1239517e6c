"""Published weights as bytes: a state dict as a numpy ``.npz`` archive, read back with ``allow_pickle=False`` and
checked finite, since whatever comes back from Redis is untrusted. numpy, not torch's format, so that a rollout
acting with the built-in MLP on a CPU reads them without importing torch.
"""

from __future__ import annotations

import io
import zipfile
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """A module's state dict as numpy arrays on the host (bfloat16 and float16 as float32, which numpy holds)."""
    import torch

    def array(tensor: torch.Tensor) -> np.ndarray:
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor).numpy()

    return {name: array(tensor) for name, tensor in model.state_dict().items()}


def weights_to_bytes(model: nn.Module) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **state_arrays(model))
    return buffer.getvalue()


def _torch_archive(blob: bytes) -> bool:
    """Weights in torch's own format (a zip holding ``data.pkl``): what versions before the npz wrote. Read still,
    so that a rollout upgraded before its trainer, and old checkpoints, keep loading."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except zipfile.BadZipFile:
        return False


def _load(blob: bytes) -> dict[str, np.ndarray]:
    if _torch_archive(blob):
        import torch

        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items()
        ):
            raise ValueError("weights that are not a state dict of tensors")
        odd = [name for name, t in state.items() if t.layout != torch.strided or t.device.type != "cpu"]
        if odd:  # sparse or meta tensors, which torch.load also makes: nothing a model of ours holds
            raise ValueError(
                f"weights with tensors that are not dense CPU tensors: {', '.join(map(str, odd[:5]))}"
            )
        return {
            name: t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy() for name, t in state.items()
        }
    loaded = np.load(io.BytesIO(blob), allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"weights that are one array, not a state dict: {type(loaded).__name__}")
    with loaded:
        return {name: loaded[name] for name in loaded.files}


def weights_from_bytes(blob: bytes) -> dict[str, np.ndarray]:
    """Published weights, checked: ValueError for a blob that is not a state dict of numbers or holds non-finite
    values (one NaN in them and every action of every rollout is NaN)."""
    try:
        state = _load(blob)
    except Exception as error:  # zip, npy header or unpickling errors: a blob we did not write
        raise ValueError(f"weights that do not load: {type(error).__name__}: {error}") from None
    odd = [name for name, a in state.items() if a.dtype.kind not in "biufc"]
    if odd:  # strings, structured or void arrays: nothing a model of ours holds
        raise ValueError(f"weights with arrays that are not numbers: {', '.join(odd[:5])}")
    bad = [name for name, a in state.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if bad:
        raise ValueError(f"weights with NaN or infinity in {', '.join(bad)}")
    return state


def load_weights(model: nn.Module, blob: bytes) -> None:
    """Published weights into ``model``: ValueError for weights that do not load, are not finite, or do not fit."""
    import torch

    try:
        model.load_state_dict({name: torch.as_tensor(a) for name, a in weights_from_bytes(blob).items()})
    except (KeyError, TypeError, RuntimeError) as error:  # a state dict of something else
        raise ValueError(f"weights that do not fit their spec: {type(error).__name__}: {error}") from None
