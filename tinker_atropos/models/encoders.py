"""Observation encoders: what sits between a structured observation and the MLP heads.

An observation travels flat (a Dict's entries concatenated in key order, an image as its H x W x C values). The
layout in the spec (``obs_layout``: each entry's key and shape) says how to split it back: an image entry
(H x W x C) goes through a small CNN, the others as they are, and the features are concatenated, one encoder per
key as SB3's ``CombinedExtractor``. Observations arrive normalised (the network's running statistics), so the CNN
needs no division by 255.
"""

from __future__ import annotations

import math

import torch
from torch import nn

IMAGE_FEATURES = 256


def image_cnn(shape: tuple[int, int, int]) -> tuple[nn.Module, int]:
    """A CNN over [B, C, H, W]: the Nature-DQN shape for images of at least 36 x 36, two 3 x 3 stride-2
    convolutions for smaller ones; then a linear layer to ``IMAGE_FEATURES``. (module, output width)."""
    height, width, channels = shape
    if min(height, width) >= 36:
        convolutions = [
            nn.Conv2d(channels, 32, 8, 4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, 2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1),
            nn.ReLU(),
        ]
    else:
        convolutions = [
            nn.Conv2d(channels, 16, 3, 2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, 2, padding=1),
            nn.ReLU(),
        ]
    trunk = nn.Sequential(*convolutions, nn.Flatten())
    with torch.no_grad():
        flat = trunk(torch.zeros(1, channels, height, width)).shape[1]
    return nn.Sequential(trunk, nn.Linear(flat, IMAGE_FEATURES), nn.ReLU()), IMAGE_FEATURES


class ObservationEncoder(nn.Module):
    """Flat observations [B, D] -> features [B, out_dim]: each layout entry's slice, an image one through its CNN."""

    def __init__(self, layout: list[tuple[str, list[int]]]) -> None:
        super().__init__()
        self.slices: list[tuple[int, int, tuple[int, ...] | None]] = []  # (start, end, image shape or None)
        self.cnns = nn.ModuleDict()
        start, self.out_dim = 0, 0
        for _key, shape in layout:  # entries in the flat observation's order
            size = math.prod(shape)
            image = tuple(shape) if len(shape) == 3 else None
            if image is not None:
                self.cnns[str(len(self.slices))], width = image_cnn(image)  # keys may hold dots: index them
            else:
                width = size
            self.slices.append((start, start + size, image))
            start, self.out_dim = start + size, self.out_dim + width
        self.in_dim = start

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        features = []
        for index, (start, end, image) in enumerate(self.slices):
            part = observations[:, start:end]
            if image is not None:  # [B, H*W*C] -> [B, C, H, W]
                part = self.cnns[str(index)](part.reshape(-1, *image).permute(0, 3, 1, 2))
            features.append(part)
        return features[0] if len(features) == 1 else torch.cat(features, dim=1)
