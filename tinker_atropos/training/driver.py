"""What the trainer process runs: drivers of training, each behind one small interface (as small as Acme's).

A driver is one way the core is driven: the experience loop (Redis experience in, weights out), the Atropos loop
(scored groups from the trajectory API) or the Tinker API (a client's own training loop). ``TrainerService``
composes the ones the config enables.

Like an Acme worker that is also a ``Saveable``, a driver hands out its state and takes it back; when to write it,
where, how many to keep, what to do when the disk refuses and whether the run folder is still the run's is the one
``Checkpointer``'s business (``checkpointing.py``), the same for every driver. A driver that keeps its state its own
way (the Tinker API: a snapshot per state-changing request) gets no checkpointer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tinker_atropos.protocol.v1 import services_pb2


@dataclass(frozen=True)
class Checkpoint:
    """A driver's state as ``save`` gives it: plain data (tensors, numbers, dicts) that loads wherever the classes
    move, a copy that the driver's next steps leave alone, and the policy version that names the file."""

    version: int
    state: dict[str, Any]
    # once it is on disk (the experience loop prunes its replay journal)
    written: Callable[[], None] | None = None


class Driver(Protocol):
    def run(self, stop: threading.Event) -> None:
        """Drive training until ``stop`` is set (or there is nothing left to drive)."""
        ...

    def status(self) -> services_pb2.TrainerStatus:
        """Its part of the trainer's status: the fields it drives."""
        ...

    def close(self) -> None:
        """Release what it holds (its servers, its counts), once ``run`` returned or raised and its last checkpoint
        was written."""
        ...

    def save(self) -> Checkpoint | None:
        """Its state now, taken between two of its steps (it may be called from another thread); None while it has
        nothing to keep (not set up yet)."""
        ...

    def restore(self, state: dict[str, Any], source: Path) -> None:
        """Go on from ``state``, as ``save`` gave it or as an earlier version of it wrote it, read from ``source`` (for
        its log); called before ``run``."""
        ...

    def progress(self) -> int:
        """How many steps (updates) it has taken since it started: what ``trainer.checkpoint.every_updates``
        counts."""
        ...
