"""Assertions several test files make: two nested states alike to the bit, a checkpoint that outlives the package's
layout, a rendered video that moves."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import imageio.v3 as iio
import numpy as np
import torch


def assert_same(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


def assert_names_nothing_of_the_package(checkpoint: Path) -> None:
    """The checkpoint's pickle names no class or function of tinker_atropos: one it named would be imported by its
    module path when loading, so moving it (as TrainingCore and ReplayBuffer moved to training/) would break
    every checkpoint written before."""
    named: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            named.add(f"{module}.{name}")
            return super().find_class(module, name)

    recording = SimpleNamespace(Unpickler=Recording, load=pickle.load, __name__="pickle")
    torch.load(checkpoint, map_location="cpu", weights_only=False, pickle_module=recording)
    assert named, "the walk saw the pickle's classes (torch's own storages at least)"
    assert not {n for n in named if n.startswith("tinker_atropos")}, sorted(named)


def assert_moving_video(mp4: Path, frames: int) -> None:
    video = np.stack(list(iio.imiter(mp4)))
    assert video.shape[0] == frames and video.shape[-1] == 3, video.shape
    assert len({frame.tobytes() for frame in video}) > frames // 2, "the frames should not be all the same"
    assert video.std() > 5, "a blank picture"
    gif = np.stack(list(iio.imiter(mp4.with_suffix(".gif"))))
    assert gif.shape[0] >= 2 and len({frame.tobytes() for frame in gif}) > 1
