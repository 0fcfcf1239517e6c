"""Everything the Tinker API must not lose, in Redis under the run's namespace (``ta:{run}:tinker:…``): sessions,
models, sampling sessions and every request as a future. A restarted trainer finds them all, and the requests it
had not finished are still queued.

A model's requests are numbered by the client (``seq_id``); the number is the request's identity: a retried POST
with a number already taken gets the first request's future back, never a second application. A numbered request
refused before it was queued (a bad body, one too large, a wrong key) is noted as refused: once a later number of
the model arrives, the worker answers the refused one as failed, so that the model's order moves on.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

PENDING, DONE, FAILED = b"pending", b"done", b"failed"
MAX_REFUSALS = (
    1024  # refused numbers noted per model and not yet answered: what a client without a key can add
)
QUEUE_WINDOW = 256  # queued requests the worker looks at for one it can start
SAMPLER_LANE = "sampler:"  # the lane of the requests that sample from one model: this and its weights' path


def sampler_lane(base_model: str, model_path: str | None) -> str:
    return f"{SAMPLER_LANE}{model_path or base_model}"


@dataclass(frozen=True)
class Upcoming:
    """What the worker could start: each loaded model's next request, the reason of a model's next number when
    it was refused and a later one came (answer it as failed), and the head of the queue as (request, lane)."""

    requests: dict[str, str]
    refused: dict[str, str]
    queued: list[tuple[str, str]]


@dataclass(frozen=True)
class Result:
    status: bytes  # PENDING, DONE or FAILED
    body: bytes = b""  # a result's bytes (JSON or Protobuf)
    content_type: str = "application/json"


class Keys:
    """The run's Tinker namespace in Redis."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client, self.run, self.prefix = client, run, f"ta:{run}:tinker"

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))


class Store(Keys):
    def __init__(self, client: redis.Redis, run: str, future_ttl_s: float = 3600.0) -> None:
        super().__init__(client, run)
        self.future_ttl_s = int(future_ttl_s)
        self.runs = TrainingRuns(client, run)

    # sessions ------------------------------------------------------------------------------------------
    def create_session(self, fields: dict[str, Any]) -> str:
        session = f"session-{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.client.hset(self._key("session", session), mapping={"created_at": now, "heartbeat_at": now,
                                                                  "info": json.dumps(fields)})  # fmt: skip
        return session

    def session_state(self, session: str) -> str | None:
        """None for an unknown session, "" for a live one, else why it finished."""
        key = self._key("session", session)
        created, finished = self.client.hmget(key, ["created_at", "finished"])
        if created is None:
            return None
        return finished.decode() if finished else ""

    def stale_sessions(self, sessions: set[str], older_than: float) -> list[str]:
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

    def finish_session(self, session: str, reason: str) -> list[str]:
        """Mark the session finished (first reason wins); the models it created, to unload."""
        key = self._key("session", session)
        self.client.hsetnx(key, "finished", reason)
        return [m for m in self.models() if m.startswith(f"{session}:")]

    # models --------------------------------------------------------------------------------------------
    def add_model(self, model_id: str, record: dict[str, Any]) -> bool:
        """Register a model (False when its id exists: a retried creation)."""
        key = self._key("model", model_id)
        if not self.client.hsetnx(key, "record", json.dumps(record)):
            return False
        self.client.hset(key, mapping={"applied_seq": -1, "snapshot_seq": -1, "last_request_at": time.time()})
        self.client.sadd(self._key("models"), model_id)
        self.client.sadd(self._key("runs"), model_id)
        return True

    def model(self, model_id: str) -> dict[str, Any] | None:
        raw = self.client.hget(self._key("model", model_id), "record")
        return None if raw is None else json.loads(raw)

    def update_model(self, model_id: str, record: dict[str, Any]) -> None:
        self.client.hset(self._key("model", model_id), "record", json.dumps(record))

    def models(self) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(self._key("models")))

    def progress(self, model_id: str) -> tuple[int, int, str | None]:
        """(last applied seq, seq of the last snapshot, the snapshot's path)."""
        applied, snapshot, path = self.client.hmget(
            self._key("model", model_id), ["applied_seq", "snapshot_seq", "snapshot_path"]
        )
        return int(applied or -1), int(snapshot or -1), path.decode() if path else None

    def model_if_loaded(self, model_id: str) -> tuple[dict[str, Any] | None, bool]:
        """The model's record (None: no such model) and whether it is loaded, in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(self._key("model", model_id), "record").sismember(self._key("models"), model_id)
            raw, loaded = pipe.execute()
        return (None if raw is None else json.loads(raw)), bool(loaded)

    def is_loaded(self, model_id: str) -> bool:
        return bool(self.client.sismember(self._key("models"), model_id))

    def unload_model(self, model_id: str) -> None:
        self.client.srem(self._key("models"), model_id)

    # requests ------------------------------------------------------------------------------------------
    def submit(self, kind: str, body: bytes, model_id: str = "", seq: int | None = None,
               dedup: str | None = None, lane: str = "") -> str:  # fmt: skip
        """Queue a request and return its future's id. With ``seq`` it is the model's request of that number,
        with ``dedup`` the request of that key; when it is taken, the existing future's id. A request outside
        any model's numbers runs in ``lane`` (the model it changes, or the sampler it samples from), after the
        lane's earlier ones and beside other lanes'."""
        request_id = f"req-{uuid.uuid4().hex}"
        future = self._key("future", request_id)
        self.client.hset(future, mapping={"kind": kind, "model_id": model_id, "seq": -1 if seq is None else seq,
                                          "status": PENDING, "body": body, "created_at": time.time(),
                                          "lane": lane or model_id})  # fmt: skip
        if seq is not None:
            claimed = self.client.hsetnx(self._key("model", model_id, "ops"), str(seq), request_id)
            existing = None if claimed else self.client.hget(self._key("model", model_id, "ops"), str(seq))
        elif dedup is not None:
            claimed = self.client.set(self._key("dedup", dedup), request_id, nx=True, ex=self.future_ttl_s)
            existing = None if claimed else self.client.get(self._key("dedup", dedup))
        else:
            existing = None
        if existing is not None:
            self.client.delete(future)
            return existing.decode()
        if seq is None:
            self.client.rpush(self._key("queue"), request_id)
        return request_id

    def refuse(self, model_id: str, seq: int, reason: str) -> bool:
        """Note that the model's request ``seq`` was refused before it was queued (``reason``); whether it was
        noted: not for an unknown model, a number taken or applied, nor past ``MAX_REFUSALS`` pending."""
        key = self._key("model", model_id)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(key, "applied_seq").hexists(self._key("model", model_id, "ops"), str(seq))
            pipe.hlen(self._key("model", model_id, "refused"))
            applied, taken, pending = pipe.execute()
        if applied is None or seq <= int(applied) or taken or pending >= MAX_REFUSALS:
            return False
        self.client.hset(self._key("model", model_id, "refused"), str(seq), reason)
        return True

    def take_refusal(self, model_id: str, seq: int, reason: str) -> str:
        """The model's request ``seq`` as one that fails with ``reason`` (or the request that took the number
        first): what the worker answers a refused number with."""
        return self.submit("refused", reason.encode(), model_id, seq=seq)

    def next_requests(self, applied: dict[str, int]) -> Upcoming:
        """What could run next, in three round trips. ``applied``: the last applied number of the models the
        caller knows (the worker, their only writer); the others' are read and added to it, and the models no
        longer loaded are removed from it."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.smembers(self._key("models")).lrange(self._key("queue"), 0, QUEUE_WINDOW - 1)
            members, queue = pipe.execute()
        models = sorted(m.decode() for m in members)
        unknown = [m for m in models if m not in applied]
        queued = [q.decode() for q in queue]
        with self.client.pipeline(transaction=False) as pipe:
            for model_id in unknown:
                pipe.hget(self._key("model", model_id), "applied_seq")
            for request_id in queued:
                pipe.hget(self._key("future", request_id), "lane")
            replies = pipe.execute()
        for model_id, raw in zip(unknown, replies, strict=False):
            applied[model_id] = int(raw or -1)
        for model_id in [m for m in applied if m not in set(models)]:
            del applied[model_id]  # unloaded
        lanes = [(raw or b"").decode() for raw in replies[len(unknown) :]]
        with self.client.pipeline(transaction=False) as pipe:
            for model_id in models:
                ops, refused, following = (self._key("model", model_id, "ops"), self._key("model", model_id, "refused"),
                                           str(applied[model_id] + 2))  # fmt: skip
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
        return Upcoming(requests, refusals, list(zip(queued, lanes, strict=True)))

    def waiting(self, model_id: str, after: int) -> list[str]:
        """The model's requests numbered past ``after`` and still pending."""
        numbered = [(int(seq), request_id.decode())
                    for seq, request_id in self.client.hgetall(self._key("model", model_id, "ops")).items()]  # fmt: skip
        later = [request_id for seq, request_id in sorted(numbered) if seq > after]
        with self.client.pipeline(transaction=False) as pipe:
            for request_id in later:
                pipe.hget(self._key("future", request_id), "status")
            statuses = pipe.execute()
        return [request_id for request_id, status in zip(later, statuses, strict=True) if status == PENDING]

    def op(self, model_id: str, seq: int) -> str | None:
        raw = self.client.hget(self._key("model", model_id, "ops"), str(seq))
        return None if raw is None else raw.decode()

    def request(self, request_id: str) -> tuple[str, bytes, str, int] | None:
        """(kind, body, model_id, seq) of a request whose payload is still kept."""
        kind, body, model_id, seq = self.client.hmget(self._key("future", request_id),
                                                      ["kind", "body", "model_id", "seq"])  # fmt: skip
        if kind is None:
            return None
        return kind.decode(), body or b"", (model_id or b"").decode(), int(seq)

    def finish(self, request_id: str, status: bytes, body: bytes, content_type: str = "application/json",
               applied: tuple[str, int] | None = None, snapshot: tuple[int, str] | None = None) -> None:  # fmt: skip
        """Store a request's outcome in one transaction with what it changed: ``applied``, the (model, seq) now
        applied, and ``snapshot``, the (seq, file) of the model's state it left."""
        future = self._key("future", request_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(future, mapping={"status": status, "result": body, "content_type": content_type})
            pipe.expire(future, self.future_ttl_s)
            if applied is not None:
                pipe.hset(self._key("model", applied[0]), mapping={"applied_seq": applied[1],
                                                                   "last_request_at": time.time()})  # fmt: skip
                pipe.hdel(self._key("model", applied[0], "refused"), str(applied[1]))
                if snapshot is not None:
                    pipe.hset(self._key("model", applied[0]),
                              mapping={"snapshot_seq": snapshot[0], "snapshot_path": snapshot[1]})  # fmt: skip
            else:
                pipe.lrem(self._key("queue"), 1, request_id)
            pipe.execute()

    def forget_payload(self, request_id: str) -> None:
        """A request that no replay needs any more keeps its result only."""
        self.client.hdel(self._key("future", request_id), "body")

    def result(self, request_id: str) -> Result | None:
        status, body, content_type = self.client.hmget(self._key("future", request_id),
                                                       ["status", "result", "content_type"])  # fmt: skip
        if status is None:
            return None
        return Result(status, body or b"", (content_type or b"application/json").decode())

    def retrieved(self, request_id: str) -> None:
        """A result handed out is kept a little longer for a lost reply, not for the whole TTL."""
        self.client.expire(self._key("future", request_id), 120)

    # sampling sessions ---------------------------------------------------------------------------------
    def add_sampler(self, sampler_id: str, base_model: str, model_path: str | None) -> None:
        self.client.hset(self._key("sampler", sampler_id),
                         mapping={"base_model": base_model, "model_path": model_path or ""})  # fmt: skip

    def sampler(self, sampler_id: str) -> tuple[str, str | None] | None:
        base, path = self.client.hmget(self._key("sampler", sampler_id), ["base_model", "model_path"])
        return None if base is None else (base.decode(), path.decode() or None if path else None)


class TrainingRuns(Keys):
    """What the SDK's RestClient reads: a training run is a model, loaded or not (its ``training_run_id`` is the
    model id; ``Store.add_model`` lists it), and its checkpoints are those saved under a name, each with its
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
        return {cid.decode(): json.loads(raw)
                for cid, raw in self.client.hgetall(self._key("checkpoints", model_id)).items()}  # fmt: skip

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
