"""The models the clients created (``model:<id>``: its record, the last request number applied, its latest
snapshot, when it last ran a request), and which of them are loaded (the set ``models``). A model stays a
training run (the set ``runs``, ``TrainingRuns``) once unloaded."""

from __future__ import annotations

import json
import time
from typing import Any

from tinker_atropos.tinker_api.store.namespace import Keys


class Models(Keys):
    def add(self, model_id: str, record: dict[str, Any]) -> bool:
        """Register a model (False when its id exists: a retried creation)."""
        key = self._key("model", model_id)
        if not self.client.hsetnx(key, "record", json.dumps(record)):
            return False
        self.client.hset(key, mapping={"applied_seq": -1, "snapshot_seq": -1, "last_request_at": time.time()})
        self.client.sadd(self._key("models"), model_id)
        self.client.sadd(self._key("runs"), model_id)
        return True

    def record(self, model_id: str) -> dict[str, Any] | None:
        raw = self.client.hget(self._key("model", model_id), "record")
        return None if raw is None else json.loads(raw)

    def update(self, model_id: str, record: dict[str, Any]) -> None:
        self.client.hset(self._key("model", model_id), "record", json.dumps(record))

    def loaded(self) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(self._key("models")))

    def of_session(self, session: str) -> list[str]:
        """The loaded models ``session`` created."""
        return [m for m in self.loaded() if m.startswith(f"{session}:")]

    def progress(self, model_id: str) -> tuple[int, int, str | None]:
        """(last applied seq, seq of the last snapshot, the snapshot's path)."""
        applied, snapshot, path = self.client.hmget(
            self._key("model", model_id), ["applied_seq", "snapshot_seq", "snapshot_path"]
        )
        return int(applied or -1), int(snapshot or -1), path.decode() if path else None

    def record_if_loaded(self, model_id: str) -> tuple[dict[str, Any] | None, bool]:
        """The model's record (None: no such model) and whether it is loaded, in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(self._key("model", model_id), "record").sismember(self._key("models"), model_id)
            raw, loaded = pipe.execute()
        return (None if raw is None else json.loads(raw)), bool(loaded)

    def is_loaded(self, model_id: str) -> bool:
        return bool(self.client.sismember(self._key("models"), model_id))

    def unload(self, model_id: str) -> None:
        self.client.srem(self._key("models"), model_id)
