"""Where a frozen policy computes: numpy on a CPU, where torch is never imported (a rollout acting on a few
instances pays about 3x per op in torch), or torch tensors on a device. The policy's forward pass uses only
operations the two spell alike, through ``xp``; this holds what they spell differently: parameters and observations
in, results out, and the random draws."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np


class ArrayLibrary:
    def __init__(self, library: Literal["numpy", "torch"], device: str, rng: np.random.Generator) -> None:
        self.device, self.rng = device, rng
        if library == "torch":
            import torch

            self.xp: Any = torch
        else:
            self.xp = np

    def parameter(self, array: np.ndarray) -> Any:
        """A float32 parameter in this library, contiguous, on its device; no autograd graph, so acting needs no
        inference_mode around it (a cost on every step)."""
        array = np.ascontiguousarray(array, dtype=np.float32)
        if self.xp is np:
            return array.copy()
        return self.xp.as_tensor(array, device=self.device).clone()

    def observations(self, obs: np.ndarray) -> Any:
        if self.xp is np:
            return np.asarray(obs, dtype=np.float32)
        return self.xp.as_tensor(obs, dtype=self.xp.float32, device=self.device)

    def numpy(self, array: Any) -> np.ndarray:
        return array if self.xp is np else array.cpu().numpy()

    def normal(self, shape: tuple[int, ...], deterministic: bool) -> Any:
        """A standard-normal draw; zeros (a Gaussian's mean) when acting deterministically."""
        if self.xp is np:
            if deterministic:
                return np.zeros(shape, np.float32)
            return self.rng.standard_normal(shape, dtype=np.float32)
        return (self.xp.zeros if deterministic else self.xp.randn)(shape, device=self.device)

    def uniform(self, shape: tuple[int, ...]) -> Any:
        if self.xp is np:
            return self.rng.random(shape, dtype=np.float32)
        return self.xp.rand(shape, device=self.device)
