"""What the trainer process runs: drivers of training, each behind one small interface (as small as Acme's).

A driver is one way the core is driven: the experience loop (Redis experience in, weights out), the Atropos loop
(scored groups from the trajectory API) or the Tinker API (a client's own training loop). ``TrainerService``
composes the ones the config enables."""

from __future__ import annotations

import threading
from typing import Protocol

from tinker_atropos.protocol.v1 import services_pb2


class Driver(Protocol):
    def run(self, stop: threading.Event) -> None:
        """Drive training until ``stop`` is set (or there is nothing left to drive)."""
        ...

    def status(self) -> services_pb2.TrainerStatus:
        """Its part of the trainer's status: the fields it drives."""
        ...

    def close(self) -> None:
        """Release what it holds (a last checkpoint, its servers, its counts), once ``run`` returned or raised."""
        ...
