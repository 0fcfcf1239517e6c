"""The lanes the worker runs requests in (each training model's, each sample's; ``dispatch.py`` says which start
next), and what the dispatcher knows of them, shared with the lanes' threads under one lock and read as one view:
per model the last request number applied, and the lanes running a request. Read apart, a lane ending in between
would show its model's old number with its lane free, and the number would start again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tinker_atropos.tinker_api.engine.dispatch import Job, lane_tenant
from tinker_atropos.tinker_api.store.samplers import SAMPLER_LANE


class Lanes:
    """Per model the last request number applied (this worker is its only writer), the lanes running a request
    (lane -> request id) and the threads running them; ``wake`` is rung as a lane ends."""

    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake
        self.lock = threading.Lock()
        self.applied: dict[str, int] = {}
        self.busy: dict[str, str] = {}
        self.threads: set[threading.Thread] = set()

    def view(self) -> tuple[dict[str, int], set[str]]:
        """The numbers applied and the lanes busy, as of one instant."""
        with self.lock:
            return dict(self.applied), set(self.busy)

    def learn(self, applied: dict[str, int]) -> None:
        """The numbers of ``applied`` (as ``Requests.next_requests`` completed it from the store) for the models not
        known yet; the models it lacks are unloaded, and forgotten once their lane is free."""
        with self.lock:
            for model_id, seq in applied.items():
                self.applied.setdefault(model_id, seq)
            for model_id in [m for m in self.applied if m not in applied and m not in self.busy]:
                del self.applied[model_id]

    def applied_to(self, model_id: str, seq: int) -> None:
        """The model's request ``seq`` is applied, and recorded so in the store."""
        with self.lock:
            self.applied[model_id] = seq

    def sampling_tenants(self) -> set[str]:
        """The tenants with a sample running."""
        with self.lock:
            return {lane_tenant(lane) for lane in self.busy if lane.startswith(SAMPLER_LANE)}

    def start(self, run: list[Job], apply: Callable[[list[Job]], None], threaded: bool) -> None:
        """``apply`` the jobs of ``run``, in a thread of its own or in this one; their lanes are busy until it
        returns (it raises nothing)."""
        with self.lock:
            self.busy.update({lane: request_id for lane, request_id, _ in run})
        if not threaded:
            self._run(run, apply)
            return
        thread = threading.Thread(
            target=self._run,
            args=(run, apply),
            daemon=True,
            name=f"tinker-lane {'+'.join(lane for lane, _, _ in run)}",
        )
        self.threads.add(thread)
        thread.start()

    def _run(self, run: list[Job], apply: Callable[[list[Job]], None]) -> None:
        try:
            apply(run)
        finally:
            with self.lock:
                for lane, _, _ in run:
                    self.busy.pop(lane, None)
            self.threads.discard(threading.current_thread())
            self.wake.set()

    def join(self, timeout_s: float) -> None:
        """Wait for the lanes' threads, ``timeout_s`` for them all."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
