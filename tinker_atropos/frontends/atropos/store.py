"""The trajectory API's state in Redis (``ta:{run}:atropos:…``), so that a restarted API service finds its queue,
its registrations, its step counter and the batches it had formed, where the reference keeps them in process
memory.

One API process owns the state (a Kubernetes Deployment of one replica, ``Recreate``): it keeps a mirror in
memory for the packing maths, and every request's change is one MULTI/EXEC, applied to the mirror only once Redis
took it. Group bodies live in Redis alone, so the process's memory does not grow with the queue; the queue is
bounded (``atropos.max_queue_sequences``). A retried post (same body) is recognised by its digest among the latest
``atropos.dedup_window`` groups and not queued twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any

import pydantic_core
import redis
from redis.connection import PythonRespSerializer

from tinker_atropos.frontends.atropos.mirror import Entry, Mirror, load, place
from tinker_atropos.frontends.atropos.packing import EnvEntry, Queued, env_status, next_batch
from tinker_atropos.state.records import parse_json

log = logging.getLogger(__name__)


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


def _sending_values_whole(client: redis.Redis) -> None:
    """``client``'s commands packed by redis-py's own packer, which sends a large value as it is: hiredis's (the
    default where it is installed) copies each command whole, so a 64 MiB group stored, and kept as the latest,
    cost 250 MiB more and held the GIL for 0.15 s. Its connections so far are dropped (none is in use yet)."""
    pool = client.connection_pool
    pool.connection_kwargs["command_packer"] = PythonRespSerializer(
        6000, pool.get_encoder().encode
    )  # redis-py's cutoff
    pool.disconnect()
    pool.reset()


class TrajectoryStore:
    """The reference server's operations over Redis; each returns the reference's JSON answer."""

    def __init__(self, client: redis.Redis, run: str, max_queue_sequences: int, dedup_window: int) -> None:
        _sending_values_whole(client)
        self.client, self.prefix = client, f"ta:{run}:atropos"
        self.max_queue_sequences, self.dedup_window = max_queue_sequences, dedup_window
        self.stale = False  # a call failed on Redis (``read_back``): the next one reads the state back first
        self.state = load(self.client, self._key, self.dedup_window)

    def read_back(self) -> None:
        """A call failed on Redis: its change may be half-made in the mirror, which the next call reads back."""
        self.stale = True

    def fresh(self) -> Mirror:
        """The mirror, read back from Redis first if a request failed on it since."""
        if self.stale:
            self.state, self.stale = load(self.client, self._key, self.dedup_window), False
        return self.state

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # registration ------------------------------------------------------------------------------------------
    def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        m = self.fresh()
        if not m.registered:  # a later trainer's registration changes nothing, as in the reference
            step = registration["starting_step"]
            meta = {"registered": 1, "started": 0, "step": step, "registration": json.dumps(registration)}
            self.client.hset(self._key("meta"), mapping=meta)
            m.registered, m.started, m.step, m.registration = True, False, step, registration
        return {"uuid": uuid.uuid4().int}  # as the reference: a random 128-bit id that nothing later uses

    def register_env(self, fields: dict[str, Any]) -> dict[str, Any]:
        m = self.fresh()
        if not m.started:
            return {"status": "wait for trainer to start"}
        name = fields["desired_name"]
        entry = EnvEntry(
            max_context_len=fields["max_token_length"],
            weight=fields["weight"] if fields["weight"] is not None else 1.0,
            desired_name=name,
            real_name=f"{name}_{sum(e.desired_name == name for e in m.envs)}",
            registered_id=len(m.envs),
            last_update=time.time(),
            connected=True,
            min_batch_allocation=fields.get("min_batch_allocation"),
            group_size=fields["group_size"],
        )
        self.client.rpush(self._key("envs"), json.dumps(asdict(entry)))
        m.envs.append(entry)
        r = m.registration
        return {
            "status": "success",
            "env_id": entry.registered_id,
            "wandb_name": entry.real_name,
            "checkpoint_dir": r.get("checkpoint_dir", ""),
            "starting_step": m.step,
            "checkpoint_interval": r.get("save_checkpoint_interval"),
            "num_steps": r.get("num_steps"),
        }

    def _save_env(self, pipe: Any, env_id: int) -> None:
        pipe.lset(self._key("envs"), env_id, json.dumps(asdict(self.state.envs[env_id])))

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        if not 0 <= env_id < len(self.fresh().envs):
            return {"status": "failure", "error": "list index out of range"}
        with self.client.pipeline(transaction=True) as pipe:
            self.state.envs[env_id].connected = False
            self._save_env(pipe, env_id)
            pipe.execute()
        return {"status": "success"}

    def info(self) -> dict[str, Any]:
        m = self.fresh()
        r = m.registration if m.registered else {}
        return {"batch_size": r.get("batch_size", -1), "max_token_len": r.get("max_token_len", -1)}

    def wandb_info(self) -> dict[str, Any]:
        m = self.fresh()
        r = m.registration if m.registered else {}
        return {"group": r.get("wandb_group"), "project": r.get("wandb_project")}

    # scored data ---------------------------------------------------------------------------------------------
    def post(self, groups: list[dict[str, Any]], encoded: list[bytes] | None = None) -> list[dict[str, Any]]:
        """Queue (or buffer) each group; the reference's answer for each. QueueFull before any change when
        the new groups would pass the bound; a group seen among the latest is answered, not queued again.
        ``encoded``: each group's ``encode``, when the caller made it already (off the event loop)."""
        m = self.fresh()
        encoded = encoded if encoded is not None else [encode(g) for g in groups]
        stored = {id(g): e for g, e in zip(groups, encoded, strict=True)}
        digests = [hashlib.sha256(e).hexdigest() for e in encoded]
        new = {d: g for g, d in zip(groups, digests, strict=True) if d not in m.digest_set}
        incoming = sum(len(g["tokens"]) for g in new.values())
        if new and m.queued_sequences() + incoming > self.max_queue_sequences:
            self.client.hincrby(self._key("meta"), "groups_refused_full", len(new))
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
            latest_body = self.client.hget(self._key("groups"), str(latest))
        with self.client.pipeline(transaction=True) as pipe:
            if bodies:
                pipe.hset(self._key("groups"), mapping={str(k): stored[id(v)] for k, v in bodies.items()})
            if len(queue) > len(m.queue):
                pipe.rpush(self._key("queue"), *(e.encode() for e in queue[len(m.queue) :]))
            for env_id in touched:
                pipe.delete(self._key("buffer", str(env_id)))
                if buffers[env_id]:
                    pipe.rpush(self._key("buffer", str(env_id)), *(e.encode() for e in buffers[env_id]))
            if latest_body is not None:
                pipe.set(self._key("latest"), latest_body)
            if fresh:
                pipe.lpush(self._key("digests"), *fresh)
                pipe.ltrim(self._key("digests"), 0, self.dedup_window - 1)
            pipe.hset(self._key("meta"), "next_gid", gid)
            pipe.hincrby(self._key("meta"), "groups_received", len(bodies))
            pipe.hincrby(self._key("meta"), "groups_buffered", buffered)
            pipe.hincrby(self._key("meta"), "groups_duplicate", duplicates)
            pipe.execute()
        m.queue, m.buffers, m.next_gid = queue, {k: v for k, v in buffers.items() if v}, gid
        m.remember(fresh, self.dedup_window)
        m.counters["groups_received"] += len(bodies)
        m.counters["groups_buffered"] += buffered
        m.counters["groups_duplicate"] += duplicates
        return answers

    def refuse_invalid(self, groups: int) -> None:
        """Count ``groups`` refused with 422 (a trainer could not have learned from them)."""
        self.client.hincrby(self._key("meta"), "groups_refused_invalid", groups)
        self.fresh().counters["groups_refused_invalid"] += groups

    # batches -----------------------------------------------------------------------------------------------
    def batch(self) -> dict[str, Any]:
        m = self.fresh()
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
                    self.client.hset(self._key("meta"), "started", 1)
                    m.started = True
                return {"batch": None}
        pending = m.pending + formed
        serve = pending[-1]
        bodies = self.client.hmget(self._key("groups"), [str(e.gid) for e in serve])
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("meta"), mapping={"started": 1, "step": m.step + len(formed)})
            if formed:
                pipe.delete(self._key("queue"))
                if queue:
                    pipe.rpush(self._key("queue"), *(e.encode() for e in queue))
                pipe.rpush(self._key("pending"), *(json.dumps([e.fields() for e in b]) for b in formed))
            pipe.rpop(self._key("pending"))
            pipe.hdel(self._key("groups"), *(str(e.gid) for e in serve))
            pipe.hincrby(self._key("meta"), "batches_served", 1)
            groups = []
            for entry, raw in zip(serve, bodies, strict=True):
                try:
                    group = parse_json(raw)
                    if not isinstance(group, dict) or not isinstance(group.get("tokens"), list):
                        raise ValueError("not a scored group")
                    groups.append(group)
                except (ValueError, TypeError):  # lost or overwritten in Redis: the batch goes without it
                    log.warning("group %d of a batch is missing or malformed in Redis; skipped", entry.gid)
                    pipe.hincrby(self._key("meta"), "records_skipped", 1)
            pipe.hincrby(self._key("meta"), "sequences_served", sum(len(g["tokens"]) for g in groups))
            pipe.execute()
        m.started, m.step, m.queue, m.pending = True, m.step + len(formed), queue, pending[:-1]
        m.counters["batches_served"] += 1
        m.counters["sequences_served"] += sum(len(g["tokens"]) for g in groups)
        m.counters["records_skipped"] += len(serve) - len(groups)
        return {"batch": groups}

    def latest_example(self) -> Any:
        raw = self.client.get(self._key("latest"))
        if raw is None:  # the reference's answer before any group: each field empty
            return {name: [] for name in EXAMPLE_FIELDS}
        return parse_json(raw)

    # status ------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        m = self.fresh()
        return (
            {"current_step": m.step, "queue_size": len(m.queue)}
            if m.registered
            else {"current_step": 0, "queue_size": 0}
        )

    def status_env(self, env_id: int) -> dict[str, Any] | None:
        """None for an env id never registered."""
        m = self.fresh()
        if not 0 <= env_id < len(m.envs):
            return None
        queued = [Queued(e.size, e.env_id) for e in m.queue]
        answer, group_size = env_status(queued, m.envs, env_id, m.step, m.registration.get("batch_size", 0))
        if group_size != m.envs[env_id].group_size:
            with self.client.pipeline(transaction=True) as pipe:
                m.envs[env_id].group_size = group_size
                self._save_env(pipe, env_id)
                pipe.execute()
        return answer

    def reset(self) -> None:
        keys = list(self.client.scan_iter(match=self._key("*"), count=1000))
        if keys:
            self.client.delete(*keys)
        self.state = Mirror()

    def figures(self) -> dict[str, Any]:
        """For the status and the registry (the heartbeat thread): read only, never a reload."""
        m = self.state
        return {
            **m.counters,
            "step": m.step,
            "queue_groups": len(m.queue),
            "queue_sequences": m.queued_sequences(),
            "pending_batches": len(m.pending),
            "envs_registered": len(m.envs),
            "envs_connected": sum(e.connected for e in m.envs),
        }
