"""The queues of samples, one per tenant (``queue:tenant:<session>``, the session that sent them; the tenants with
one in ``tenants``): the worker takes the tenants in turn, whatever one of them has queued, and each tenant's queue
is bounded on its own, so that a flooding client fills only its own."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from tinker_atropos.tinker_api.store.namespace import Keys

# a tenant leaves the set of tenants with queued samples only while its queue is empty (a sample queued meanwhile
# keeps it there)
_FORGET_EMPTY = (
    "if redis.call('LLEN', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end return 0"
)


class SampleQueues(Keys):
    """Each tenant's queue of samples; ``tenants_key``: the set of the tenants with one."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        super().__init__(client, run)
        self.tenants_key = self._key("tenants")

    def queue(self, tenant: str) -> str:
        return self._key("queue", "tenant", tenant)

    def push(self, tenant: str, request_id: str, max_queued: int, dropped: Iterable[str]) -> bool:
        """Queue the tenant's sample; False when ``max_queued`` of theirs already wait (0: no bound): then it
        leaves the queue in one transaction with the keys ``dropped`` (its future, its key against a resend)."""
        queue = self.queue(tenant)
        with self.client.pipeline(transaction=True) as pipe:
            length = pipe.rpush(queue, request_id).sadd(self.tenants_key, tenant).execute()[0]
        if not max_queued or length <= max_queued:
            return True
        with self.client.pipeline(transaction=True) as pipe:
            pipe.lrem(queue, 1, request_id).delete(*dropped).execute()
        return False

    def tenants(self) -> set[str]:
        """The tenants with samples queued (or running: they leave their queue once answered)."""
        return {tenant.decode() for tenant in self.client.smembers(self.tenants_key)}

    def heads(self, tenants: list[str], window: int) -> dict[str, list[str]]:
        """The first ``window`` samples of each tenant's queue; the tenants whose queue is empty leave
        ``tenants``."""
        with self.client.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.lrange(self.queue(tenant), 0, window - 1)
            heads = pipe.execute()
        samples = {t: [r.decode() for r in head] for t, head in zip(tenants, heads, strict=True) if head}
        for tenant in set(tenants) - set(samples):
            self.client.eval(_FORGET_EMPTY, 2, self.queue(tenant), self.tenants_key, tenant)
        return samples

    def drain(self, tenant: str) -> list[str]:
        """Empty the tenant's queue, which leaves the tenants; the samples it held."""
        queue = self.queue(tenant)
        with self.client.pipeline(transaction=True) as pipe:
            queued = pipe.lrange(queue, 0, -1).delete(queue).srem(self.tenants_key, tenant).execute()[0]
        return [request_id.decode() for request_id in queued]

    def leave(self, pipe: redis.client.Pipeline, tenant: str, request_id: str) -> None:
        """The answered sample leaves its tenant's queue, on the caller's transaction (every copy: a resent
        push)."""
        pipe.lrem(self.queue(tenant), 0, request_id)
