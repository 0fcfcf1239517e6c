"""Service logging: the one line format, warnings counted by reason so that a flood stays readable, and MuJoCo's
warnings among them."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from types import ModuleType

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


def route_mujoco_warnings() -> None:
    """MuJoCo's warnings (a deprecated attribute in a model's XML, an unstable simulation) into this log, counted,
    from when this process imports MuJoCo (at once if it has). Without a handler MuJoCo prints each one and appends
    it to ``MUJOCO_LOG.TXT`` in the working directory: a file no one reads, left wherever a service or a test was
    started (``make test`` left one in the repository). Costs nothing where MuJoCo is never imported (a finder
    waits for its import: ``import mujoco`` takes 0.4 s); idempotent."""
    module = sys.modules.get("mujoco")
    if module is not None:
        _handle_mujoco_warnings(module)
    elif not any(isinstance(finder, _WhenMujocoImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenMujocoImported())


_mujoco_warnings = CountedWarnings("MuJoCo warnings")


def _mujoco_warning(message: str) -> None:
    # the reason: its first clause, numbers (a time, a DOF) out, so that one kind of warning is one reason
    reason = re.split(r"[:.] ", re.sub(r"\d+(\.\d+)?", "N", message.strip()))[0][:100]
    _mujoco_warnings.add(reason, message.strip())


def _handle_mujoco_warnings(mujoco: ModuleType) -> None:
    if mujoco.get_mju_user_warning() is not _mujoco_warning:
        mujoco.set_mju_user_warning(_mujoco_warning)


class _WhenMujocoImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``mujoco`` is imported it leaves ``sys.meta_path`` and hands on the spec the
    other finders give, its loader's ``exec_module`` followed by ``_handle_mujoco_warnings``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "mujoco":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if isinstance(loader, importlib.abc.Loader) and hasattr(loader, "exec_module"):
            execute = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                execute(module)
                _handle_mujoco_warnings(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's loader only
        return spec
