"""Trainer figures: busy fraction and policy lag over a sliding window, the writes into the run folder."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from tinker_atropos.state.run_dir import FolderWrites

BUSY_WINDOW_S = 10.0


class BusyMeter:
    """Fraction of the last ``window_s`` seconds spent inside updates."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self._spans: deque[tuple[float, float]] = deque()

    def record(self, start: float, end: float) -> None:
        self._spans.append((start, end))

    def fraction(self) -> float:
        now = time.monotonic()
        since = max(self.started, now - self.window_s)
        while self._spans and self._spans[0][1] < since:
            self._spans.popleft()
        busy = sum(min(end, now) - max(start, since) for start, end in self._spans)
        return busy / max(now - since, 1e-9)


class LagMeter:
    """Policy lag (trainer version minus acting version) of the latest accepted chunks."""

    def __init__(self, size: int = 200) -> None:
        self._lags: deque[int] = deque(maxlen=size)

    def record(self, lag: int) -> None:
        self._lags.append(lag)

    def summary(self) -> tuple[float, float, float]:
        if not self._lags:
            return 0.0, 0.0, 0.0
        return float(min(self._lags)), sum(self._lags) / len(self._lags), float(max(self._lags))

    def counts(self) -> dict[int, int]:
        """How many of the latest chunks had each lag: the distribution, not only its extremes."""
        return dict(sorted(Counter(self._lags).items()))


def write_figures(writes: FolderWrites) -> dict[str, Any]:
    """The trainer status's fields of ``writes``: how many failed, the failure going on and for how long."""
    return {
        "writes_failed": {writes.what: writes.failed},
        "write_failure": writes.error,
        "write_failures": {writes.what: writes.error} if writes.error else {},
        "write_failing_s": writes.failing_s,
    }
