"""Trainer checkpoints on disk: written atomically, kept to a retention count, corrupt ones skipped.

A checkpoint is one ``torch.save`` of everything needed to resume (parameters, optimizer, normaliser
statistics, counters, policy version, RNG states). Writing goes to a temporary file that is renamed into place,
so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"


def checkpoint_path(directory: Path, version: int) -> Path:
    return directory / f"{PREFIX}{version:010d}.pt"


def save_checkpoint(directory: Path, version: int, state: dict[str, Any], keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = checkpoint_path(directory, version)
    import torch  # here, not at the top: readers of checkpoint names (``up``) need not load torch

    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(directory.glob(f"{PREFIX}*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return target


def read_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint file's state, on the CPU; torch's error when it does not load."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def load_latest_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; a truncated or corrupt one is skipped with a warning."""
    for path in sorted(directory.glob(f"{PREFIX}*.pt"), reverse=True):
        try:
            return path, read_checkpoint(path)
        except Exception as error:  # any unpickling/zip failure means the file is unusable
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, error)
    return None
