"""A model's requests, numbered by the client (``seq_id``): ``model:<id>:ops`` maps each number to its request,
``model:<id>:refused`` each number refused before it was queued to why, and the model's hash holds the last number
applied. The number is the request's identity: a retried POST with a number already taken gets the first request's
future back, never a second application. A refused number (a bad body, one too large, a wrong key) is answered as
failed once a later number of the model arrives, so that the model's order moves on."""

from __future__ import annotations

import time

import redis

from tinker_atropos.tinker_api.store.namespace import Keys

# refused numbers noted per model and not yet answered: what a client without a key can add
MAX_REFUSALS = 1024


class NumberedRequests(Keys):
    """Each model's numbered requests, its refused numbers, and the last number it applied."""

    def _ops(self, model_id: str) -> str:
        return self._key("model", model_id, "ops")

    def _refused(self, model_id: str) -> str:
        return self._key("model", model_id, "refused")

    def claim(self, model_id: str, seq: int, request_id: str) -> str | None:
        """Number ``seq`` of the model for ``request_id``; the request that took it first, if one did."""
        ops = self._ops(model_id)
        claimed = self.client.hsetnx(ops, str(seq), request_id)
        existing = None if claimed else self.client.hget(ops, str(seq))
        return None if existing is None else existing.decode()

    def refuse(self, model_id: str, seq: int, reason: str) -> bool:
        """Note that the model's request ``seq`` was refused before it was queued (``reason``); whether it was
        noted: not for an unknown model, a number taken or applied, nor past ``MAX_REFUSALS`` pending."""
        key = self._key("model", model_id)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(key, "applied_seq").hexists(self._ops(model_id), str(seq))
            pipe.hlen(self._refused(model_id))
            applied, taken, pending = pipe.execute()
        if applied is None or seq <= int(applied) or taken or pending >= MAX_REFUSALS:
            return False
        self.client.hset(self._refused(model_id), str(seq), reason)
        return True

    def op(self, model_id: str, seq: int) -> str | None:
        """The model's request numbered ``seq``."""
        raw = self.client.hget(self._ops(model_id), str(seq))
        return None if raw is None else raw.decode()

    def after(self, model_id: str, seq: int) -> list[str]:
        """The model's requests numbered past ``seq``, in their order."""
        numbered = [
            (int(number), request_id.decode())
            for number, request_id in self.client.hgetall(self._ops(model_id)).items()
        ]
        return [request_id for number, request_id in sorted(numbered) if number > seq]

    def upcoming(self, models: list[str], applied: dict[str, int]) -> tuple[dict[str, str], dict[str, str]]:
        """Each model's next request, and the reason of a model's next number when it was refused and a later one
        came (answer it as failed). ``applied``: the last applied number of the models the caller knows; the
        others' are read and added to it, and the models not in ``models`` (no longer loaded) removed from it."""
        unknown = [m for m in models if m not in applied]
        with self.client.pipeline(transaction=False) as pipe:
            for model_id in unknown:
                pipe.hget(self._key("model", model_id), "applied_seq")
            for model_id, raw in zip(unknown, pipe.execute(), strict=True):
                applied[model_id] = int(raw or -1)
        for model_id in [m for m in applied if m not in set(models)]:
            del applied[model_id]  # unloaded
        with self.client.pipeline(transaction=False) as pipe:
            for model_id in models:
                ops, refused = self._ops(model_id), self._refused(model_id)
                following = str(applied[model_id] + 2)
                pipe.hget(ops, str(applied[model_id] + 1)).hget(refused, str(applied[model_id] + 1))
                pipe.hexists(ops, following).hexists(refused, following)
            replies = pipe.execute()
        requests, refusals = {}, {}
        for i, model_id in enumerate(models):
            request, refused, later, later_refused = replies[4 * i : 4 * i + 4]
            if request is not None:
                requests[model_id] = request.decode()
            elif refused is not None and (later or later_refused):
                refusals[model_id] = refused.decode(errors="replace")
        return requests, refusals

    def applied(
        self, pipe: redis.client.Pipeline, model_id: str, seq: int, snapshot: tuple[int, str] | None
    ) -> None:
        """On the caller's transaction: the model's request ``seq`` is applied, and ``snapshot``, the (seq, file)
        of the model's state it left, if any, is its latest."""
        key = self._key("model", model_id)
        pipe.hset(key, mapping={"applied_seq": seq, "last_request_at": time.time()})
        pipe.hdel(self._refused(model_id), str(seq))
        if snapshot is not None:
            pipe.hset(key, mapping={"snapshot_seq": snapshot[0], "snapshot_path": snapshot[1]})
