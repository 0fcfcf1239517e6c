"""Trainer checkpoints on disk: written atomically, kept to a retention count, corrupt ones skipped.

A checkpoint is one ``torch.save`` of everything needed to resume (parameters, optimizer, normaliser
statistics, counters, policy version, RNG states). Writing goes to a temporary file that is renamed into place,
so a crash mid-write leaves the previous checkpoint intact. Beside the latest ones, ``best.pt`` holds the policy of
the best periodic evaluation so far (``trainer.evaluation``): what ``eval --best`` and ``export --best`` load; it
is no resume point (no optimizer), and no retention count deletes it.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
BEST = "best.pt"


def checkpoint_path(directory: Path, version: int) -> Path:
    return directory / f"{PREFIX}{version:010d}.pt"


def write_atomically(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a temporary file beside ``target``, synced, then renamed onto it: a crash mid-write leaves
    what was there before."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=target.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_torch(target: Path, state: dict[str, Any]) -> None:
    """``torch.save`` of ``state`` to ``target``, atomically. Serialised in memory first: torch's file writer turns
    a full disk's OSError into a RuntimeError that names neither the file nor the cause, where a plain write of
    the bytes raises the OSError (ENOSPC, EROFS) that callers count and retry (``run_dir.FolderWrites``)."""
    import torch  # here, not at the top: readers of checkpoint names (``up``) need not load torch

    serialised = io.BytesIO()
    torch.save(state, serialised)
    write_atomically(target, lambda file: file.write(serialised.getbuffer()))


def save_checkpoint(directory: Path, version: int, state: dict[str, Any], keep: int) -> Path:
    target = checkpoint_path(directory, version)
    save_torch(target, state)
    for old in sorted(directory.glob(f"{PREFIX}*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return target


def save_best(directory: Path, state: dict[str, Any]) -> Path:
    """Replace ``best.pt`` with ``state``: {"policy": as in a checkpoint, "evaluation": its figures}."""
    target = directory / BEST
    save_torch(target, state)
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
