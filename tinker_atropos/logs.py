"""Service logging: the one line format, and warnings counted by reason so that a flood stays readable."""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger(__name__)


def configure_logging(kind: str) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {kind} %(levelname)s %(name)s: %(message)s", force=True
    )
    # httpx logs every request at INFO: the Atropos trainer's /batch polls (ten a second) would be most of the log
    logging.getLogger("httpx").setLevel(logging.WARNING)


class CountedWarnings:
    """Events counted by reason and logged at most once per ``log_interval_s`` for each reason, with the count
    since the last line: a flood of bad records, blown-up envs or refused calls is visible without flooding the
    log. A reason may name the peer (``peer_host``): beyond ``MAX_REASONS`` distinct ones, new ones count as
    ``other``, so that no peer can make it grow without bound."""

    MAX_REASONS = 1000

    def __init__(self, what: str, log_interval_s: float = 10.0) -> None:
        self.what, self.log_interval_s = what, log_interval_s
        self.totals: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}

    def add(self, reason: str, message: str, count: int = 1) -> None:
        if reason not in self.totals and len(self.totals) >= self.MAX_REASONS:
            reason = "other"
        self.totals[reason] += count
        self._unreported[reason] += count
        self._unlogged[reason] += count
        now = time.monotonic()
        last = self._logged_at.get(reason)
        if last is None or now - last >= self.log_interval_s:
            logged, self._unlogged[reason] = self._unlogged[reason], 0
            self._logged_at[reason] = now
            since = "" if last is None else f" in the last {now - last:.0f} s"
            log.warning("%d %s (%s)%s; latest: %s", logged, self.what, reason, since, message)

    def total(self) -> int:
        return sum(self.totals.values())

    def take_unreported(self) -> dict[str, int]:
        """The counts added since the last call: what a service still has to add to the run's counters."""
        counts, self._unreported = dict(self._unreported), Counter()
        return counts


def peer_host(peer: str) -> str:
    """A gRPC peer (``ipv4:127.0.0.1:53412``, ``ipv6:[::1]:53412``) without its port: who to count a refusal
    against (a client reconnecting gets a new port every time)."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        return f"{kind}:{address.rsplit(':', 1)[0]}"
    return peer
