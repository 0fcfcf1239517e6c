"""Every request as a future (``future:<id>``: its kind, model, number, lane, tenant, body, then its status and
result), the model's numbered requests (``model:<id>:ops``, number -> request; ``model:<id>:refused``, number ->
why), the queue of each tenant's samples (``queue:tenant:<session>``, the tenants with one in ``tenants``) and the
queue of the others (``queue``). A restarted trainer finds them all, and the requests it had not finished are still
queued.

Samples queue per tenant (the session that sent them) so that the worker takes them in turn, whatever one tenant
has queued, and so that one tenant's queue is bounded on its own: past ``max_queued`` its next sample is refused
(``QueueFull``, which the API answers 429).

A model's requests are numbered by the client (``seq_id``); the number is the request's identity: a retried POST
with a number already taken gets the first request's future back, never a second application. A numbered request
refused before it was queued (a bad body, one too large, a wrong key) is noted as refused: once a later number of
the model arrives, the worker answers the refused one as failed, so that the model's order moves on.

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

PENDING, DONE, FAILED = b"pending", b"done", b"failed"
# refused numbers noted per model and not yet answered: what a client without a key can add
MAX_REFUSALS = 1024
QUEUE_WINDOW = 256  # queued requests the worker looks at for one it can start
RETRIEVED_TTL_S = 120  # how long a result handed out is kept for a lost reply


class QueueFull(Exception):
    """A tenant's queue of samples is at its bound."""


# a tenant leaves the set of tenants with queued samples only while its queue is empty (a sample queued meanwhile
# keeps it there)
_FORGET_EMPTY = (
    "if redis.call('LLEN', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end return 0"
)


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
    def __init__(self, client: redis.Redis, run: str, future_ttl_s: float = 3600.0) -> None:
        super().__init__(client, run)
        self.future_ttl_s = int(future_ttl_s)
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
        if seq is None and tenant:
            self._queue_sample(request_id, tenant, max_queued, dedup)
        elif seq is None:
            self.client.rpush(self._key("queue"), request_id)
        self.arrived.set()
        return request_id

    def _queue_sample(self, request_id: str, tenant: str, max_queued: int, dedup: str | None) -> None:
        queue = self._key("queue", "tenant", tenant)
        with self.client.pipeline(transaction=True) as pipe:
            length = pipe.rpush(queue, request_id).sadd(self._key("tenants"), tenant).execute()[0]
        if max_queued and length > max_queued:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.lrem(queue, 1, request_id).delete(self._key("future", request_id))
                if dedup is not None:
                    pipe.delete(self._key("dedup", dedup))
                pipe.execute()
            raise QueueFull(f"{max_queued} samples of this session already wait")

    def tenants(self) -> set[str]:
        """The tenants with samples queued (or running: they leave their queue once answered)."""
        return {tenant.decode() for tenant in self.client.smembers(self._key("tenants"))}

    def cancel_tenant(self, tenant: str, body: bytes) -> int:
        """Fail every sample ``tenant`` has queued with ``body`` (its session ended); how many."""
        queue = self._key("queue", "tenant", tenant)
        with self.client.pipeline(transaction=True) as pipe:
            queued = pipe.lrange(queue, 0, -1).delete(queue).srem(self._key("tenants"), tenant).execute()[0]
        for request_id in queued:
            self.finish(request_id.decode(), FAILED, body, tenant=tenant)
        return len(queued)

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
        self.arrived.set()
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
            pipe.smembers(self._key("tenants"))
            members, queue, tenants = pipe.execute()
        samples = self._tenant_queues(sorted(t.decode() for t in tenants))
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
                ops, refused = self._key("model", model_id, "ops"), self._key("model", model_id, "refused")
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
        return Upcoming(requests, refusals, list(zip(queued, lanes, strict=True)), samples)

    def _tenant_queues(self, tenants: list[str]) -> dict[str, list[str]]:
        """The head of each tenant's queue of samples; the tenants whose queue is empty leave ``tenants``."""
        with self.client.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.lrange(self._key("queue", "tenant", tenant), 0, QUEUE_WINDOW - 1)
            heads = pipe.execute()
        samples = {t: [r.decode() for r in head] for t, head in zip(tenants, heads, strict=True) if head}
        for tenant in set(tenants) - set(samples):
            self.client.eval(
                _FORGET_EMPTY, 2, self._key("queue", "tenant", tenant), self._key("tenants"), tenant
            )
        return samples

    def waiting(self, model_id: str, after: int) -> list[str]:
        """The model's requests numbered past ``after`` and still pending."""
        numbered = [
            (int(seq), request_id.decode())
            for seq, request_id in self.client.hgetall(self._key("model", model_id, "ops")).items()
        ]
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
        kind, body, model_id, seq = self.client.hmget(
            self._key("future", request_id), ["kind", "body", "model_id", "seq"]
        )
        if kind is None:
            return None
        return kind.decode(), body or b"", (model_id or b"").decode(), int(seq)

    def kinds(self, request_ids: list[str]) -> list[str | None]:
        """The kind of each request (None: its future is gone), in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hget(self._key("future", request_id), "kind")
            return [None if kind is None else kind.decode() for kind in pipe.execute()]

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
                pipe.hset(
                    self._key("model", applied[0]),
                    mapping={"applied_seq": applied[1], "last_request_at": time.time()},
                )
                pipe.hdel(self._key("model", applied[0], "refused"), str(applied[1]))
                if snapshot is not None:
                    pipe.hset(
                        self._key("model", applied[0]),
                        mapping={"snapshot_seq": snapshot[0], "snapshot_path": snapshot[1]},
                    )
            elif tenant:
                pipe.lrem(self._key("queue", "tenant", tenant), 0, request_id)  # every copy: a resent push
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
