"""Sessions whose client vanished: the tinker SDK never closes its session when a script ends, it only stops
heart-beating (every 10 s). Such a session is finished and its models unloaded, so that they stop counting
against ``max_models`` and their snapshot files go. The samples of every ended session (finished, expired or
unknown), queued or running, are cancelled: a client that went away stops costing the others its queue."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from tinker_atropos.tinker_api.store import Store

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0  # at most, between two looks at the sessions' heartbeats
ENDED_CHECK_S = 1.0  # at most, between two looks for ended sessions whose samples are queued or running


class SessionExpiry:
    """Finishes the sessions without a heartbeat for ``timeout_s``, looking every quarter of it (5 s at most): a
    session ends at most 1.25 x ``timeout_s`` after its last heartbeat. A trainer that was itself down gives
    every client the timeout again from its start."""

    def __init__(
        self,
        store: Store,
        timeout_s: float,
        unload: Callable[[str], None],
        cancel_running: Callable[[str], None] = lambda tenant: None,
    ) -> None:
        self.store, self.timeout_s, self.unload, self.cancel_running = (
            store,
            timeout_s,
            unload,
            cancel_running,
        )
        self.started = time.time()
        self.next_check = self.next_ended_check = 0.0
        self.expired: Counter[str] = Counter()  # sessions_expired, models_expired: in the trainer's status

    def check(self, loaded_models: Iterable[str], sampling: Iterable[str] = ()) -> None:
        """Finish the stale sessions among those of ``loaded_models`` and those ``sampling`` (with samples queued
        or running), each of their models given to ``unload``."""
        now = time.time()
        if now < self.next_check or now - self.started < self.timeout_s:
            return
        self.next_check = now + min(CHECK_EVERY_S, self.timeout_s / 4)
        sessions = {model_id.split(":")[0] for model_id in list(loaded_models)} | set(sampling)
        for session in self.store.sessions.stale(sessions, older_than=now - self.timeout_s):
            self.store.sessions.finish(session, "heartbeat_expired")
            models = self.store.models.of_session(session)
            log.warning(
                "Tinker session %s sent no heartbeat for %.0f s: finished, its %d models unloaded",
                session,
                self.timeout_s,
                len(models),
            )
            for model_id in models:
                self.unload(model_id)
            self.expired.update(sessions_expired=1, models_expired=len(models))

    def cancel_ended(self, loaded_models: Iterable[str], running: set[str]) -> None:
        """Expire the silent sessions (``check``) among those with models loaded or samples queued or
        ``running``; then every ended session's queued samples fail, and its running ones (``cancel_running``)."""
        now = time.monotonic()
        if now < self.next_ended_check:
            return
        self.next_ended_check = now + ENDED_CHECK_S
        tenants = (self.store.requests.samples.tenants() | running) - {""}
        self.check(loaded_models, tenants)
        for tenant in sorted(tenants):
            state = self.store.sessions.state(tenant)
            if state == "":
                continue
            reason = f"session {tenant!r} ended ({state or 'unknown'}) before this sample ran"
            body = json.dumps({"error": reason, "category": "user"}).encode()
            cancelled = self.store.requests.cancel_tenant(tenant, body)
            self.cancel_running(tenant)
            log.info(
                "Tinker session %s ended: %d queued samples cancelled, its running ones too",
                tenant,
                cancelled,
            )
