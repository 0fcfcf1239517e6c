"""Every request as a future (``future:<id>``: its kind, model, number, lane, tenant, body, then its status and
result), and the queues it waits in: a model's numbered requests in their order (``numbered.py``), each tenant's
samples in its queue (``sample_queues.py``), the others in the queue (``queue``). A restarted trainer finds them all,
and the requests it had not finished are still queued.

A numbered request is the model's request of that number, a retried POST gets the first one's future back; a
request with a key against a resend (``dedup``) is the one request of that key. Past ``max_queued`` samples of one
tenant, its next sample is refused (``QueueFull``, which the API answers 429).

This is where the API and the worker meet. Besides what Redis keeps, two in-process notices spare both of them a
poll when they share this store in one process: ``arrived``, set as a request is queued or a number refused (the
worker waits on it), and ``finished``, called with each request whose outcome is stored (the long polls wait on
it). Without them each would still find the change in Redis, at its next look (0.5 s, 1 s).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from tinker_atropos.tinker_api.store.namespace import Keys
from tinker_atropos.tinker_api.store.numbered import NumberedRequests
from tinker_atropos.tinker_api.store.sample_queues import SampleQueues

PENDING, DONE, FAILED = b"pending", b"done", b"failed"
QUEUE_WINDOW = 256  # queued requests the worker looks at for one it can start
RETRIEVED_TTL_S = 120  # how long a result handed out is kept for a lost reply


class QueueFull(Exception):
    """A tenant's queue of samples is at its bound."""


@dataclass(frozen=True)
class Upcoming:
    """What the worker could start: each loaded model's next request, the reason of a model's next number when
    it was refused and a later one came (answer it as failed), the head of the queue as (request, lane), and the
    head of each tenant's queue of samples."""

    requests: dict[str, str]
    refused: dict[str, str]
    queued: list[tuple[str, str]]
    samples: dict[str, list[str]]


@dataclass(frozen=True)
class Result:
    status: bytes  # PENDING, DONE or FAILED
    body: bytes = b""  # a result's bytes (JSON or Protobuf)
    content_type: str = "application/json"


class Requests(Keys):
    """The futures, the queue, and the in-process notices; ``numbers``: each model's numbered requests,
    ``samples``: each tenant's queue of samples."""

    def __init__(self, client: redis.Redis, run: str, future_ttl_s: float = 3600.0) -> None:
        super().__init__(client, run)
        self.future_ttl_s = int(future_ttl_s)
        self.numbers = NumberedRequests(client, run)
        self.samples = SampleQueues(client, run)
        self.arrived = threading.Event()
        self.finished: list[Callable[[str], None]] = []

    def submit(
        self,
        kind: str,
        body: bytes,
        model_id: str = "",
        seq: int | None = None,
        dedup: str | None = None,
        lane: str = "",
        tenant: str = "",
        max_queued: int = 0,
    ) -> str:
        """Queue a request and return its future's id. With ``seq`` it is the model's request of that number,
        with ``dedup`` the request of that key; when it is taken, the existing future's id. A request outside
        any model's numbers runs in ``lane`` (the model it changes, or the sampler it samples from), after the
        lane's earlier ones and beside other lanes'; a sample with a ``tenant`` waits in that tenant's queue,
        QueueFull when ``max_queued`` of theirs already wait."""
        request_id = f"req-{uuid.uuid4().hex}"
        future = self._key("future", request_id)
        self.client.hset(
            future,
            mapping={
                "kind": kind,
                "model_id": model_id,
                "seq": -1 if seq is None else seq,
                "status": PENDING,
                "body": body,
                "created_at": time.time(),
                "lane": lane or model_id,
                "tenant": tenant,
            },
        )
        if seq is not None:
            existing = self.numbers.claim(model_id, seq, request_id)
        elif dedup is not None:
            existing = self._claim_key(dedup, request_id)
        else:
            existing = None
        if existing is not None:
            self.client.delete(future)
            return existing
        if seq is None and tenant:
            dropped = [future] if dedup is None else [future, self._key("dedup", dedup)]
            if not self.samples.push(tenant, request_id, max_queued, dropped):
                raise QueueFull(f"{max_queued} samples of this session already wait")
        elif seq is None:
            self.client.rpush(self._key("queue"), request_id)
        self.arrived.set()
        return request_id

    def _claim_key(self, dedup: str, request_id: str) -> str | None:
        """The key against a resend for ``request_id`` (for the futures' time to live); the request that took it
        first, if one did."""
        claimed = self.client.set(self._key("dedup", dedup), request_id, nx=True, ex=self.future_ttl_s)
        existing = None if claimed else self.client.get(self._key("dedup", dedup))
        return None if existing is None else existing.decode()

    def cancel_tenant(self, tenant: str, body: bytes) -> int:
        """Fail every sample ``tenant`` has queued with ``body`` (its session ended); how many."""
        queued = self.samples.drain(tenant)
        for request_id in queued:
            self.finish(request_id, FAILED, body, tenant=tenant)
        return len(queued)

    def refuse(self, model_id: str, seq: int, reason: str) -> bool:
        """Note the model's number ``seq`` as refused (``NumberedRequests.refuse``), waking the worker; whether
        it was noted."""
        noted = self.numbers.refuse(model_id, seq, reason)
        if noted:
            self.arrived.set()
        return noted

    def take_refusal(self, model_id: str, seq: int, reason: str) -> str:
        """The model's request ``seq`` as one that fails with ``reason`` (or the request that took the number
        first): what the worker answers a refused number with."""
        return self.submit("refused", reason.encode(), model_id, seq=seq)

    def next_requests(self, applied: dict[str, int]) -> Upcoming:
        """What could run next. ``applied``: the last applied number of the models the caller knows (the worker,
        their only writer); the others' are read and added to it, and the models no longer loaded are removed
        from it."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.smembers(self._key("models")).lrange(self._key("queue"), 0, QUEUE_WINDOW - 1)
            pipe.smembers(self.samples.tenants_key)
            members, queue, tenants = pipe.execute()
        samples = self.samples.heads(sorted(t.decode() for t in tenants), QUEUE_WINDOW)
        queued = [q.decode() for q in queue]
        lanes = [lane or "" for lane in self._field(queued, "lane")]
        requests, refusals = self.numbers.upcoming(sorted(m.decode() for m in members), applied)
        return Upcoming(requests, refusals, list(zip(queued, lanes, strict=True)), samples)

    def waiting(self, model_id: str, after: int) -> list[str]:
        """The model's requests numbered past ``after`` and still pending."""
        later = self.numbers.after(model_id, after)
        statuses, pending = self._field(later, "status"), PENDING.decode()
        return [request_id for request_id, status in zip(later, statuses, strict=True) if status == pending]

    def op(self, model_id: str, seq: int) -> str | None:
        """The model's request numbered ``seq`` (``NumberedRequests.op``)."""
        return self.numbers.op(model_id, seq)

    def request(self, request_id: str) -> tuple[str, bytes, str, int] | None:
        """(kind, body, model_id, seq) of a request whose payload is still kept."""
        kind, body, model_id, seq = self.client.hmget(
            self._key("future", request_id), ["kind", "body", "model_id", "seq"]
        )
        if kind is None:
            return None
        return kind.decode(), body or b"", (model_id or b"").decode(), int(seq)

    def kinds(self, request_ids: list[str]) -> list[str | None]:
        """The kind of each request (None: its future is gone), in one round trip."""
        return self._field(request_ids, "kind")

    def _field(self, request_ids: list[str], field: str) -> list[str | None]:
        """A field of each request's future (None: the future is gone), in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hget(self._key("future", request_id), field)
            return [None if value is None else value.decode() for value in pipe.execute()]

    def finish(
        self,
        request_id: str,
        status: bytes,
        body: bytes,
        content_type: str = "application/json",
        applied: tuple[str, int] | None = None,
        snapshot: tuple[int, str] | None = None,
        tenant: str | None = None,
    ) -> None:
        """Store a request's outcome in one transaction with what it changed: ``applied``, the (model, seq) now
        applied, and ``snapshot``, the (seq, file) of the model's state it left; a request outside any model's
        numbers leaves its queue (its ``tenant``'s, read from its future when not given)."""
        future = self._key("future", request_id)
        if applied is None and tenant is None:
            tenant = (self.client.hget(future, "tenant") or b"").decode()
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(future, mapping={"status": status, "result": body, "content_type": content_type})
            pipe.expire(future, self.future_ttl_s)
            if applied is not None:
                self.numbers.applied(pipe, *applied, snapshot)
            elif tenant:
                self.samples.leave(pipe, tenant, request_id)
            else:
                pipe.lrem(self._key("queue"), 1, request_id)
            pipe.execute()
        for listener in self.finished:
            listener(request_id)

    def forget_payload(self, request_id: str) -> None:
        """A request that no replay needs any more keeps its result only."""
        self.client.hdel(self._key("future", request_id), "body")

    def result(self, request_id: str) -> Result | None:
        status, body, content_type = self.client.hmget(
            self._key("future", request_id), ["status", "result", "content_type"]
        )
        if status is None:
            return None
        return Result(status, body or b"", (content_type or b"application/json").decode())

    def retrieved(self, request_id: str) -> None:
        """A result handed out is kept a little longer for a lost reply, not for the whole TTL."""
        self.client.expire(self._key("future", request_id), RETRIEVED_TTL_S)
