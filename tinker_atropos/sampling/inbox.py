"""The callers' side of a sampling engine: what other threads hand its thread, under one condition (requests
submitted, tenants cancelled, the engine closed), and the futures not yet answered, which say whether it is busy.
The engine's thread takes from it between two steps and sleeps on it when it has nothing to do."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from tinker_atropos.sampling import scheduler
from tinker_atropos.sampling.params import SampledTokens
from tinker_atropos.sampling.request_state import Request


class Stopped(Exception):
    """The engine was closed before the request finished."""


class Inbox:
    """The requests submitted and not yet admitted (``waiting``: oldest first, a preempted one back at its head),
    the tenants whose requests leave at the next step, and whether the engine is closed, all under ``changed``."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.waiting: deque[Request] = deque()
        # submitted and not yet answered: a request moving between the engine's queues is in none of them
        self.unanswered: list[Future[list[SampledTokens]]] = []
        self.cancelled: set[str] = set()
        self.closed = False

    def put(self, request: Request) -> None:
        """Queue ``request``; ``Stopped`` once the engine is closed."""
        with self.changed:
            if self.closed:
                raise Stopped("the sampling engine is closed")
            self.waiting.append(request)
            self.unanswered.append(request.future)
            self.changed.notify()

    def cancel(self, tenant: str) -> None:
        with self.changed:
            self.cancelled.add(tenant)
            self.changed.notify()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify()

    def wait(self, working: Callable[[], bool]) -> bool:
        """Sleep until the engine is ``working`` (asked under the lock), has a tenant to cancel or is closed;
        whether it is still open."""
        with self.changed:
            while not self.closed and not working() and not self.cancelled:
                self.changed.wait()
            return not self.closed

    def take_cancelled(self) -> set[str]:
        """The tenants cancelled since last asked."""
        with self.changed:
            tenants, self.cancelled = self.cancelled, set()
        return tenants

    def take(self, which: Callable[[Request], bool]) -> list[Request]:
        """Take the waiting requests ``which`` names out of the queue."""
        with self.changed:
            taken = [r for r in self.waiting if which(r)]
            for request in taken:
                self.waiting.remove(request)
        return taken

    def admit(
        self, flight: Sequence[Request], kv_tokens: int, preempt: bool
    ) -> tuple[Request | None, Request | None]:
        """``scheduler.next_admission`` over the waiting requests, the one it admits taken out of the queue."""
        with self.changed:
            admitted, preempted = scheduler.next_admission(self.waiting, flight, kv_tokens, preempt)
            if admitted is not None:
                self.waiting.remove(admitted)
        return admitted, preempted

    def requeue(self, request: Request) -> None:
        """Back to the head of the queue, to start over (preempted)."""
        with self.changed:
            self.waiting.appendleft(request)

    def busy(self) -> bool:
        """Whether a request is not yet answered (asked of another thread, while the engine's may be moving one)."""
        with self.changed:
            self.unanswered = [future for future in self.unanswered if not future.done()]
            return bool(self.unanswered)
