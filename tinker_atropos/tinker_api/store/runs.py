"""What the SDK's ``RestClient`` reads: the training runs and the records of their checkpoints."""

from __future__ import annotations

import json
from typing import Any

from tinker_atropos.tinker_api.store.namespace import Keys


class TrainingRuns(Keys):
    """What the SDK's RestClient reads: a training run is a model, loaded or not (its ``training_run_id`` is the
    model id; ``Models.add`` lists it), and its checkpoints are those saved under a name, each with its
    record (``created_at``, ``size_bytes``, ``public``, ``user_metadata``, ``expires_at``); the ones that expire
    are also in one sorted set, for the sweeper."""

    def ids(self) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(self._key("runs")))

    def last_request_at(self, model_id: str) -> float:
        raw = self.client.hget(self._key("model", model_id), "last_request_at")
        return float(raw or 0.0)

    def add_checkpoint(self, model_id: str, checkpoint_id: str, info: dict[str, Any]) -> None:
        """Record (or replace) the checkpoint ``checkpoint_id`` (``weights/<name>``, ``sampler_weights/<name>``)."""
        self.client.hset(self._key("checkpoints", model_id), checkpoint_id, json.dumps(info))
        self.expire_at(model_id, checkpoint_id, info.get("expires_at"))

    def checkpoints(self, model_id: str) -> dict[str, dict[str, Any]]:
        return {
            cid.decode(): json.loads(raw)
            for cid, raw in self.client.hgetall(self._key("checkpoints", model_id)).items()
        }

    def checkpoint(self, model_id: str, checkpoint_id: str) -> dict[str, Any] | None:
        raw = self.client.hget(self._key("checkpoints", model_id), checkpoint_id)
        return None if raw is None else json.loads(raw)

    def update_checkpoint(self, model_id: str, checkpoint_id: str, **fields: Any) -> bool:
        """Change fields of a checkpoint's record; False when there is no such checkpoint."""
        info = self.checkpoint(model_id, checkpoint_id)
        if info is None:
            return False
        self.add_checkpoint(model_id, checkpoint_id, {**info, **fields})
        return True

    def remove_checkpoint(self, model_id: str, checkpoint_id: str) -> bool:
        """Forget a checkpoint; False when there was none."""
        self.client.zrem(self._key("checkpoint_expiry"), f"{model_id} {checkpoint_id}")
        return bool(self.client.hdel(self._key("checkpoints", model_id), checkpoint_id))

    def expired_checkpoints(self, now: float) -> list[tuple[str, str]]:
        """(model, checkpoint) of the checkpoints whose ``ttl_seconds`` ran out by unix time ``now``."""
        expired = self.client.zrangebyscore(self._key("checkpoint_expiry"), "-inf", now)
        pairs = [member.decode().split(" ", 1) for member in expired]
        return [(model_id, checkpoint_id) for model_id, checkpoint_id in pairs]

    def expire_at(self, model_id: str, checkpoint_id: str, expires_at: float | None) -> None:
        """When the sweeper deletes a checkpoint (a listed one, or the unnamed weights of a sampling client, which
        are not listed); None: never."""
        member = f"{model_id} {checkpoint_id}"
        if expires_at is None:
            self.client.zrem(self._key("checkpoint_expiry"), member)
        else:
            self.client.zadd(self._key("checkpoint_expiry"), {member: expires_at})
