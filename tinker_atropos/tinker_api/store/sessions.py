"""The clients' sessions: created, heart-beaten, finished (``session:<id>``: created_at, heartbeat_at, info, and
why it finished)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tinker_atropos.tinker_api.store.namespace import Keys


class Sessions(Keys):
    def create(self, fields: dict[str, Any]) -> str:
        session = f"session-{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.client.hset(
            self._key("session", session),
            mapping={"created_at": now, "heartbeat_at": now, "info": json.dumps(fields)},
        )
        return session

    def state(self, session: str) -> str | None:
        """None for an unknown session, "" for a live one, else why it finished."""
        created, finished = self.client.hmget(self._key("session", session), ["created_at", "finished"])
        if created is None:
            return None
        return finished.decode() if finished else ""

    def stale(self, sessions: set[str], older_than: float) -> list[str]:
        """Those of ``sessions`` (live ones) whose last heartbeat is older than unix time ``older_than``."""
        stale = []
        for session in sorted(sessions):
            beat, finished = self.client.hmget(self._key("session", session), ["heartbeat_at", "finished"])
            if beat is not None and not finished and float(beat) < older_than:
                stale.append(session)
        return stale

    def heartbeat(self, session: str) -> bool:
        """False for an unknown or finished session."""
        key = self._key("session", session)
        finished, exists = self.client.hmget(key, ["finished"])[0], self.client.exists(key)
        if not exists or finished:
            return False
        self.client.hset(key, "heartbeat_at", time.time())
        return True

    def finish(self, session: str, reason: str) -> None:
        """Mark the session finished (the first reason wins); its models are ``Models.of_session``'s to unload."""
        self.client.hsetnx(self._key("session", session), "finished", reason)
