"""An off-policy learner's replay buffer on disk, beside the trainer's checkpoints, written a little at a time.

Each checkpoint appends one segment: the transitions added since the previous checkpoint, numbered by how many the
buffer had taken in before them (``segment-START-END.npz``, START included, END not). The checkpoint itself records
only END, how many the buffer had taken in. So a checkpoint writes megabytes, not the whole buffer (gigabytes for
a million Humanoid transitions, and a copy per kept checkpoint), and its cost does not grow with the buffer.

On resume the buffer is refilled with the latest transitions numbered below the checkpoint's END, as many as it
holds. Segments past END (written after it, by a trainer that died before its checkpoint landed, or a newer
checkpoint that did not load) are deleted: the run goes on from END and numbers what it collects from there.
Segments a full buffer behind the latest checkpoint are pruned. A segment lost or unreadable costs its own
transitions only (older ones fill in; a replay buffer is a set to sample from, not a sequence), and the log says
how many are missing. A read-only disk costs a resume only the deletions and trims it cannot make (a warning).
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import numpy as np

from tinker_atropos.state.checkpoint_files import write_atomically
from tinker_atropos.state.run_dir import tolerated

log = logging.getLogger(__name__)

SEGMENT = re.compile(r"segment-(\d{15})-(\d{15})\.npz")


class ReplayJournal:
    """The segments of one run's replay buffer, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def segments(self) -> list[tuple[int, int, Path]]:
        """(start, end, path) of every segment, oldest first; other files are ignored."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            if match := SEGMENT.fullmatch(path.name):
                found.append((int(match[1]), int(match[2]), path))
        return sorted(found)

    def append(self, start: int, columns: dict[str, np.ndarray]) -> None:
        """Write the transitions numbered from ``start`` (oldest first) as one segment; none: nothing written."""
        count = len(columns["rewards"])
        if count == 0:
            return
        target = self.directory / f"segment-{start:015d}-{start + count:015d}.npz"
        write_atomically(target, functools.partial(_save_columns, columns=columns))

    def restore(self, end: int, capacity: int) -> dict[str, np.ndarray] | None:
        """The latest transitions numbered below ``end``, at most ``capacity`` of them, oldest first; segments past
        ``end`` are deleted, an unreadable one is skipped. None when none of them is on disk."""
        parts: list[dict[str, np.ndarray]] = []  # newest first
        wanted = remaining = min(end, capacity)
        for start, stop, path in reversed(self.segments()):
            if start >= end:
                with tolerated("delete the replay segment past the checkpoint", path):
                    path.unlink(missing_ok=True)
                continue
            if remaining == 0:
                break
            try:
                columns = _load_columns(path, stop - start)
            except Exception as error:  # any zip or format failure means the file is unusable
                log.warning("replay segment %s is unreadable (%s); skipping it", path, error)
                continue
            if stop > end:  # it ran past the checkpoint: keep only its part up to end
                columns = {name: rows[: end - start] for name, rows in columns.items()}
                with tolerated("trim the replay segment to the checkpoint", path):
                    self.append(start, columns)
                    path.unlink(missing_ok=True)
            taken = min(len(columns["rewards"]), remaining)
            parts.append({name: rows[len(rows) - taken :] for name, rows in columns.items()})
            remaining -= taken
        if remaining:
            log.warning(
                "replay buffer: %d of the latest %d transitions are no longer on disk; restoring %d",
                remaining,
                wanted,
                wanted - remaining,
            )
        if not parts:
            return None
        return {name: np.concatenate([part[name] for part in reversed(parts)]) for name in parts[0]}

    def prune(self, end: int, capacity: int) -> None:
        """Delete the segments a buffer of ``capacity`` that has taken in ``end`` transitions no longer holds."""
        for _, stop, path in self.segments():
            if stop <= end - capacity:
                path.unlink(missing_ok=True)


def _save_columns(file: object, columns: dict[str, np.ndarray]) -> None:
    np.savez(file, **columns)


def _load_columns(path: Path, count: int) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        columns = {name: data[name] for name in data.files}
    if "rewards" not in columns or any(len(rows) != count for rows in columns.values()):
        raise ValueError(f"its columns do not hold the {count} transitions its name says")
    return columns
