"""The trajectory API's state in Redis (``ta:{run}:atropos:…``), so that a restarted API service finds its queue,
its registrations, its step counter and the batches it had formed, where the reference keeps them in process
memory.

One API process owns the state (a Kubernetes Deployment of one replica, ``Recreate``): it keeps a mirror in
memory for the packing maths, and every request's change is one MULTI/EXEC, applied to the mirror only once Redis
took it. Group bodies live in Redis alone, so the process's memory does not grow with the queue; the queue is
bounded (``atropos.max_queue_sequences``). A retried post (same body) is recognised by its digest among the latest
``atropos.dedup_window`` groups and not queued twice.

The store's parts: the keys and their mirror (``redis_state.py``), the trainer's and the envs' registrations
(``registrations.py``), the batches served (``batches.py``); the groups posted are queued here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pydantic_core
import redis

from tinker_atropos.frontends.atropos.batches import Batches
from tinker_atropos.frontends.atropos.mirror import place
from tinker_atropos.frontends.atropos.redis_state import RedisState
from tinker_atropos.frontends.atropos.registrations import Registrations
from tinker_atropos.state.records import parse_json


class QueueFull(Exception):
    """The queue holds ``atropos.max_queue_sequences``: the group is refused (503), the env retries later."""


# the fields of a scored group, each an empty list in ``latest_example`` before any group was posted
EXAMPLE_FIELDS = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "generation_params",
    "inference_logprobs",
    "messages",
    "images",
)


def encode(group: dict[str, Any]) -> bytes:
    """A group's JSON as stored, and digested to recognise a retried post."""
    return pydantic_core.to_json(group)


class TrajectoryStore:
    """The reference server's operations over Redis; each returns the reference's JSON answer. Scored groups are
    posted here, into the queue (bounded, retries recognised); the queue is served in ``Batches``, the trainer and
    the envs register in ``Registrations``, and the state and its mirror are ``RedisState``'s."""

    def __init__(self, client: redis.Redis, run: str, max_queue_sequences: int, dedup_window: int) -> None:
        self.redis = RedisState(client, run, dedup_window)
        self.registrations, self.batches = Registrations(self.redis), Batches(self.redis)
        self.prefix, self.max_queue_sequences = self.redis.prefix, max_queue_sequences

    def read_back(self) -> None:
        """A call failed on Redis: the next one reads the state back first."""
        self.redis.read_back()

    # registration ------------------------------------------------------------------------------------------
    def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        return self.registrations.register(registration)

    def register_env(self, fields: dict[str, Any]) -> dict[str, Any]:
        return self.registrations.register_env(fields)

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        return self.registrations.disconnect_env(env_id)

    def info(self) -> dict[str, Any]:
        return self.registrations.info()

    def wandb_info(self) -> dict[str, Any]:
        return self.registrations.wandb_info()

    def status_env(self, env_id: int) -> dict[str, Any] | None:
        """None for an env id never registered."""
        return self.registrations.status_env(env_id)

    # scored data ---------------------------------------------------------------------------------------------
    def post(self, groups: list[dict[str, Any]], encoded: list[bytes] | None = None) -> list[dict[str, Any]]:
        """Queue (or buffer) each group; the reference's answer for each. QueueFull before any change when
        the new groups would pass the bound; a group seen among the latest is answered, not queued again.
        ``encoded``: each group's ``encode``, when the caller made it already (off the event loop)."""
        client, key, window = self.redis.client, self.redis.key, self.redis.dedup_window
        m = self.redis.fresh()
        encoded = encoded if encoded is not None else [encode(g) for g in groups]
        stored = {id(g): e for g, e in zip(groups, encoded, strict=True)}
        digests = [hashlib.sha256(e).hexdigest() for e in encoded]
        new = {d: g for g, d in zip(groups, digests, strict=True) if d not in m.digest_set}
        incoming = sum(len(g["tokens"]) for g in new.values())
        if new and m.queued_sequences() + incoming > self.max_queue_sequences:
            client.hincrby(key("meta"), "groups_refused_full", len(new))
            m.counters["groups_refused_full"] += len(new)
            raise QueueFull(
                f"the queue holds {m.queued_sequences()} sequences, at most "
                f"{self.max_queue_sequences} (atropos.max_queue_sequences): retry later"
            )
        placed = place(m, groups, digests, new)
        queue, buffers, gid, bodies = placed.queue, placed.buffers, placed.next_gid, placed.bodies
        touched, latest, answers = placed.touched, placed.latest, placed.answers
        fresh = list(dict.fromkeys(d for d in digests if d not in m.digest_set))
        duplicates = len(groups) - len(bodies)
        buffered = sum(a["status"] == "buffered" for a in answers)
        latest_body = stored[id(bodies[latest])] if latest in bodies else None
        if latest is not None and latest_body is None:  # a group buffered by an earlier request
            latest_body = client.hget(key("groups"), str(latest))
        with client.pipeline(transaction=True) as pipe:
            if bodies:
                pipe.hset(key("groups"), mapping={str(k): stored[id(v)] for k, v in bodies.items()})
            if len(queue) > len(m.queue):
                pipe.rpush(key("queue"), *(e.encode() for e in queue[len(m.queue) :]))
            for env_id in touched:
                pipe.delete(key("buffer", str(env_id)))
                if buffers[env_id]:
                    pipe.rpush(key("buffer", str(env_id)), *(e.encode() for e in buffers[env_id]))
            if latest_body is not None:
                pipe.set(key("latest"), latest_body)
            if fresh:
                pipe.lpush(key("digests"), *fresh)
                pipe.ltrim(key("digests"), 0, window - 1)
            pipe.hset(key("meta"), "next_gid", gid)
            pipe.hincrby(key("meta"), "groups_received", len(bodies))
            pipe.hincrby(key("meta"), "groups_buffered", buffered)
            pipe.hincrby(key("meta"), "groups_duplicate", duplicates)
            pipe.execute()
        m.queue, m.buffers, m.next_gid = queue, {k: v for k, v in buffers.items() if v}, gid
        m.remember(fresh, window)
        m.counters["groups_received"] += len(bodies)
        m.counters["groups_buffered"] += buffered
        m.counters["groups_duplicate"] += duplicates
        return answers

    def refuse_invalid(self, groups: int) -> None:
        """Count ``groups`` refused with 422 (a trainer could not have learned from them)."""
        self.redis.client.hincrby(self.redis.key("meta"), "groups_refused_invalid", groups)
        self.redis.fresh().counters["groups_refused_invalid"] += groups

    # batches -----------------------------------------------------------------------------------------------
    def batch(self) -> dict[str, Any]:
        return self.batches.batch()

    def latest_example(self) -> Any:
        raw = self.redis.client.get(self.redis.key("latest"))
        if raw is None:  # the reference's answer before any group: each field empty
            return {name: [] for name in EXAMPLE_FIELDS}
        return parse_json(raw)

    # status ------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        m = self.redis.fresh()
        return (
            {"current_step": m.step, "queue_size": len(m.queue)}
            if m.registered
            else {"current_step": 0, "queue_size": 0}
        )

    def reset(self) -> None:
        self.redis.reset()

    def figures(self) -> dict[str, Any]:
        """For the status and the registry (the heartbeat thread): read only, never a reload."""
        m = self.redis.mirror
        return {
            **m.counters,
            "step": m.step,
            "queue_groups": len(m.queue),
            "queue_sequences": m.queued_sequences(),
            "pending_batches": len(m.pending),
            "envs_registered": len(m.envs),
            "envs_connected": sum(e.connected for e in m.envs),
        }
