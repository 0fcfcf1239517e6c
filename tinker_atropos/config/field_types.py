"""The value types that several sections share: a torch device, how a rollout reaches an env service, and the
'auto' of a size the launcher computes."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?|auto", value):
        raise ValueError("allowed devices: cpu, cuda, cuda:N, auto")
    return value


Device = Annotated[str, AfterValidator(_device)]
Transport = Literal["auto", "grpc"]  # how a rollout reaches an env service: see RolloutSection.transport
Auto = Literal["auto"]  # a size the launcher computes from the machine (launcher/sizing.py)
