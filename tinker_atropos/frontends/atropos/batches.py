"""Batches for the trainer: formed from the queue by the packing rule (``packing.next_batch``) when none is
pending, kept in Redis until served (the last formed first), each served once; the step counter counts the batches
formed. A group lost or malformed in Redis is skipped and counted, the batch goes without it."""

from __future__ import annotations

import json
import logging
from typing import Any

from tinker_atropos.frontends.atropos.mirror import Entry
from tinker_atropos.frontends.atropos.packing import Queued, next_batch
from tinker_atropos.frontends.atropos.redis_state import RedisState
from tinker_atropos.state.records import parse_json

log = logging.getLogger(__name__)


class Batches:
    """The reference server's ``/batch`` over the run's state."""

    def __init__(self, state: RedisState) -> None:
        self.state = state

    def batch(self) -> dict[str, Any]:
        """The next batch (None while none can be formed; the first such answer starts the run, as the reference's
        does), or the reference's error before the trainer registered."""
        client, key = self.state.client, self.state.key
        m = self.state.fresh()
        if not m.registered:
            return {
                "status": "error",
                "message": "Trainer not registered. Call /register first.",
                "batch": [],
            }
        formed: list[list[Entry]] = []
        queue = list(m.queue)
        if not m.pending:
            batch_size = m.registration["batch_size"]
            while (
                chosen := next_batch([Queued(e.size, e.env_id) for e in queue], batch_size, m.envs)
            ) is not None:
                formed.append([queue[i] for i in chosen])
                taken = set(chosen)
                queue = [e for i, e in enumerate(queue) if i not in taken]
            if not formed:
                if not m.started:
                    client.hset(key("meta"), "started", 1)
                    m.started = True
                return {"batch": None}
        pending = m.pending + formed
        serve = pending[-1]
        bodies = client.hmget(key("groups"), [str(e.gid) for e in serve])
        with client.pipeline(transaction=True) as pipe:
            pipe.hset(key("meta"), mapping={"started": 1, "step": m.step + len(formed)})
            if formed:
                pipe.delete(key("queue"))
                if queue:
                    pipe.rpush(key("queue"), *(e.encode() for e in queue))
                pipe.rpush(key("pending"), *(json.dumps([e.fields() for e in b]) for b in formed))
            pipe.rpop(key("pending"))
            pipe.hdel(key("groups"), *(str(e.gid) for e in serve))
            pipe.hincrby(key("meta"), "batches_served", 1)
            groups = []
            for entry, raw in zip(serve, bodies, strict=True):
                try:
                    group = parse_json(raw)
                    if not isinstance(group, dict) or not isinstance(group.get("tokens"), list):
                        raise ValueError("not a scored group")
                    groups.append(group)
                except (ValueError, TypeError):  # lost or overwritten in Redis: the batch goes without it
                    log.warning("group %d of a batch is missing or malformed in Redis; skipped", entry.gid)
                    pipe.hincrby(key("meta"), "records_skipped", 1)
            pipe.hincrby(key("meta"), "sequences_served", sum(len(g["tokens"]) for g in groups))
            pipe.execute()
        m.started, m.step, m.queue, m.pending = True, m.step + len(formed), queue, pending[:-1]
        m.counters["batches_served"] += 1
        m.counters["sequences_served"] += sum(len(g["tokens"]) for g in groups)
        m.counters["records_skipped"] += len(serve) - len(groups)
        return {"batch": groups}
