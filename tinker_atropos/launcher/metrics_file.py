"""``metrics.jsonl``, where ``up``'s progress (``progress.py``) appends one row per report, each whole or not at
all. A file the disk refuses (full, read-only) keeps its rows in memory (the latest ``PENDING_ROWS``) until it
takes them again: one console line when it starts failing, one when it works again (``FolderWrites``)."""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console

from tinker_atropos.state.run_dir import FolderWrites

PENDING_ROWS = 10_000  # rows kept while metrics.jsonl cannot be written: 5.5 hours of reports every 2 s


class MetricsFile:
    """The run's metrics.jsonl at ``path``, and the rows that wait for it."""

    def __init__(self, path: Path, console: Console) -> None:
        self.path, self.console = path, console
        self.writes = FolderWrites(
            "metrics rows",
            "they wait in memory",
            report=lambda line: console.print(f"[yellow]{line}", highlight=False),
        )
        self._pending: deque[str] = deque(maxlen=PENDING_ROWS)  # rows not yet in metrics.jsonl

    def append(self, row: dict[str, Any]) -> None:
        """The row, after those still waiting, once a write is due (a failed one is retried later)."""
        self._pending.append(json.dumps(row) + "\n")
        if self.writes.due():
            self.writes.attempt(self.path, self._write_pending)

    def _write_pending(self) -> None:
        """Append the rows waiting, all or none: a write the disk cuts short is cut back off, so that no half
        row is left for a reader (or the next row) to trip on."""
        data = memoryview("".join(self._pending).encode())
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(descriptor, 0, os.SEEK_END)
            try:
                while data:
                    data = data[os.write(descriptor, data) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(descriptor, end)
                raise
        finally:
            os.close(descriptor)
        self._pending.clear()

    def close(self) -> None:
        """Rows the file never took are said to be lost, in one line."""
        if self._pending:
            self.console.print(
                f"[yellow]{len(self._pending)} metrics rows never reached {self.path} ({self.writes.error})",
                highlight=False,
            )
