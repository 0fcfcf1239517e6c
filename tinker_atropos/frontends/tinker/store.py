"""Everything the Tinker API must not lose, in Redis under the run's namespace (``ta:{run}:tinker:…``): sessions,
models, sampling sessions and every request as a future. A restarted trainer finds them all, and the requests it
had not finished are still queued.

A model's requests are numbered by the client (``seq_id``); the number is the request's identity: a retried POST
with a number already taken gets the first request's future back, never a second application.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

PENDING, DONE, FAILED = b"pending", b"done", b"failed"


@dataclass(frozen=True)
class Result:
    status: bytes  # PENDING, DONE or FAILED
    body: bytes = b""  # a result's bytes (JSON or Protobuf)
    content_type: str = "application/json"


class Store:
    def __init__(self, client: redis.Redis, run: str, future_ttl_s: float = 3600.0) -> None:
        self.client, self.prefix, self.future_ttl_s = client, f"ta:{run}:tinker", int(future_ttl_s)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

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
        self.client.hset(key, mapping={"applied_seq": -1, "snapshot_seq": -1})
        self.client.sadd(self._key("models"), model_id)
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
               dedup: str | None = None) -> str:  # fmt: skip
        """Queue a request and return its future's id. With ``seq`` it is the model's request of that number,
        with ``dedup`` the request of that key; when it is taken, the existing future's id."""
        request_id = f"req-{uuid.uuid4().hex}"
        future = self._key("future", request_id)
        self.client.hset(future, mapping={"kind": kind, "model_id": model_id, "seq": -1 if seq is None else seq,
                                          "status": PENDING, "body": body, "created_at": time.time()})  # fmt: skip
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

    def next_requests(self, applied: dict[str, int]) -> tuple[dict[str, str | None], str | None]:
        """The request each loaded model would run next and the queue's head, in two round trips. ``applied``:
        the last applied number of the models the caller knows (the worker, their only writer); the others'
        are read and added to it."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.smembers(self._key("models")).lindex(self._key("queue"), 0)
            members, head = pipe.execute()
        models = sorted(m.decode() for m in members)
        unknown = [m for m in models if m not in applied]
        with self.client.pipeline(transaction=False) as pipe:
            for model_id in unknown:
                pipe.hget(self._key("model", model_id), "applied_seq")
            for model_id in models:
                if model_id in applied:
                    pipe.hget(self._key("model", model_id, "ops"), str(applied[model_id] + 1))
            replies = pipe.execute()
        for model_id, raw in zip(unknown, replies, strict=False):
            applied[model_id] = int(raw or -1)
        known = iter(replies[len(unknown) :])
        upcoming = {m: (None if m in unknown else next(known)) for m in models}
        for model_id in unknown:  # their next request: one more round trip, the first time only
            upcoming[model_id] = self.client.hget(
                self._key("model", model_id, "ops"), str(applied[model_id] + 1)
            )
        for model_id in [m for m in applied if m not in upcoming]:
            del applied[model_id]  # unloaded
        decoded = {m: (raw.decode() if raw is not None else None) for m, raw in upcoming.items()}
        return decoded, head.decode() if head is not None else None

    def op(self, model_id: str, seq: int) -> str | None:
        raw = self.client.hget(self._key("model", model_id, "ops"), str(seq))
        return None if raw is None else raw.decode()

    def queued(self) -> str | None:
        """The oldest queued request that belongs to no model's sequence (sampling)."""
        raw = self.client.lindex(self._key("queue"), 0)
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
                pipe.hset(self._key("model", applied[0]), "applied_seq", applied[1])
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
