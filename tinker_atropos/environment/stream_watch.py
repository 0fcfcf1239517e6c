"""The env service's streams as its watchdog sees them: admitted up to ``env.session_limit``, ended when they do not
open in time or idle past ``env.session_idle_timeout_s``, and given up to a new session that needs their instances
once their client has sent nothing for the rollouts' lease TTL (its rollout stopped and lost its lease to the one
now asking). Ending a stream cancels it; its session then frees its instances."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import grpc

from tinker_atropos.config import EnvSection
from tinker_atropos.logs import CountedWarnings, peer_host

WATCH_INTERVAL_S = 0.5


class StreamControl(Protocol):
    """What a session needs from the carrier of its stream (gRPC or the local socket)."""

    peer: str

    def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        """End the stream with a status; never returns."""
        ...

    def cancel(self) -> None:
        """End the stream from another thread (its pending read returns)."""
        ...


@dataclass
class Stream:
    """A live stream."""

    control: StreamControl
    waiting_since: float = field(default_factory=time.monotonic)  # on its client; inf while serving it
    instances: int = 0  # held by its session, once opened
    ended: bool = False  # by the service: idle, or taken over


class StreamWatch:
    """Every live stream of one env service, under ``lock`` (the servicer's, which also guards its sessions: a
    takeover looks at both at once). ``ended`` counts and logs why streams were ended, rate-limited."""

    def __init__(self, env: EnvSection, lock: threading.Lock, takeover_after_s: float) -> None:
        self.env, self.lock, self.takeover_after_s = env, lock, takeover_after_s
        self.streams: dict[int, Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="session-watchdog", daemon=True)
        self.ended = CountedWarnings("streams ended for what their client sent or did not send")
        self.timed_out = 0
        self.taken_over = 0

    def admit(self, control: StreamControl) -> tuple[int, Stream] | None:
        """A new stream, or None past ``env.session_limit``."""
        with self.lock:
            if len(self.streams) >= self.env.session_limit:
                return None
            stream_id = next(self._ids)
            self.streams[stream_id] = Stream(control)
            return stream_id, self.streams[stream_id]

    def remove(self, stream_id: int) -> None:
        with self.lock:
            del self.streams[stream_id]

    def idle_holders(self, missing: int, now: float) -> list[Stream]:
        """Streams idle past ``takeover_after_s`` whose sessions together hold the ``missing`` instances,
        longest idle first, marked ended and counted; none if they do not hold enough. Under the lock."""
        if missing <= 0:
            return []
        idle = sorted(
            (
                s
                for s in self.streams.values()
                if s.instances and not s.ended and now - s.waiting_since > self.takeover_after_s
            ),
            key=lambda s: s.waiting_since,
        )
        taken: list[Stream] = []
        while idle and missing > 0:
            taken.append(idle.pop(0))
            missing -= taken[-1].instances
        if missing > 0:
            return []
        for holder in taken:
            holder.ended = True
        self.taken_over += len(taken)
        return taken

    def take_over(self, holders: list[Stream], asking: Stream) -> None:
        """End the streams ``idle_holders`` gave up for ``asking``'s session, saying so."""
        for holder in holders:
            self.ended.add(
                f"taken over from {peer_host(holder.control.peer)}",
                f"no step request for {self.takeover_after_s:g} s while {peer_host(asking.control.peer)} asked "
                f"for its {holder.instances} instances",
            )
            holder.control.cancel()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """End every stream (their sessions free their instances) and stop watching."""
        self._stop.set()
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            stream.control.cancel()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.end_idle(time.monotonic())

    def end_idle(self, now: float) -> None:
        """End streams that did not open within ``env.open_timeout_s`` or idled past
        ``env.session_idle_timeout_s``: a client that holds a stream without using it holds a worker and
        maybe instances."""
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            limit = self.env.session_idle_timeout_s if stream.instances else self.env.open_timeout_s
            if stream.ended or now - stream.waiting_since < limit:
                continue
            stream.ended = True
            self.timed_out += 1
            what = "no step request" if stream.instances else "no 'open' request"
            self.ended.add(f"{what} from {peer_host(stream.control.peer)}", f"{what} for {limit:.0f} s")
            stream.control.cancel()
