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

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from tinker_atropos.frontends.atropos.packing import EnvEntry, Queued, env_status, next_batch, summing_to
from tinker_atropos.state.records import parse_json

log = logging.getLogger(__name__)

COUNTERS = ("groups_received", "groups_buffered", "groups_refused_full", "groups_duplicate",
            "batches_served", "sequences_served", "records_skipped", "groups_refused_invalid")  # fmt: skip


class QueueFull(Exception):
    """The queue holds ``atropos.max_queue_sequences``: the group is refused (503), the env retries later."""


@dataclass
class _Entry:
    """A queued or buffered group: its id in ``groups`` and what the packing needs."""

    gid: int
    size: int
    env_id: int | None

    def encode(self) -> str:
        return json.dumps(self.fields())

    def fields(self) -> list[int | None]:
        return [self.gid, self.size, self.env_id]

    @classmethod
    def decode(cls, fields: Any) -> _Entry:
        """ValueError or TypeError for anything but [gid, size, env_id]."""
        gid, size, env_id = fields
        return cls(int(gid), int(size), None if env_id is None else int(env_id))


@dataclass
class _Mirror:
    registered: bool = False
    started: bool = False
    registration: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    next_gid: int = 0
    envs: list[EnvEntry] = field(default_factory=list)
    queue: list[_Entry] = field(default_factory=list)
    buffers: dict[int, list[_Entry]] = field(default_factory=dict)
    pending: list[list[_Entry]] = field(default_factory=list)  # formed batches, served last first
    digests: deque[str] = field(default_factory=deque)  # the latest groups' digests, newest first
    digest_set: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def remember(self, digests: list[str], window: int) -> None:
        """Add this request's new digests (newest last in ``digests``), keeping the latest ``window``."""
        for digest in digests:
            self.digests.appendleft(digest)
            self.digest_set.add(digest)
        while len(self.digests) > window:
            self.digest_set.discard(self.digests.pop())

    def queued_sequences(self) -> int:
        """Sequences held: queued, buffered, and in batches formed but not yet served."""
        held = [
            *self.queue,
            *(e for b in self.buffers.values() for e in b),
            *(e for b in self.pending for e in b),
        ]
        return sum(e.size for e in held)


def _fields(item: Any) -> Any:
    """What a list entry of the state stores: an env's fields, an entry's, or a batch's entries'."""
    if isinstance(item, EnvEntry):
        return asdict(item)
    if isinstance(item, _Entry):
        return item.fields()
    return [e.fields() for e in item]


def _digest(group: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(group, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TrajectoryStore:
    """The reference server's operations over Redis; each returns the reference's JSON answer."""

    def __init__(self, client: redis.Redis, run: str, max_queue_sequences: int, dedup_window: int) -> None:
        self.client, self.prefix = client, f"ta:{run}:atropos"
        self.max_queue_sequences, self.dedup_window = max_queue_sequences, dedup_window
        self.stale = False  # set when a request failed on Redis: the next one reads the state back first
        self.state = self._load()

    def fresh(self) -> _Mirror:
        """The mirror, read back from Redis first if a request failed on it since."""
        if self.stale:
            self.state, self.stale = self._load(), False
        return self.state

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # loading ----------------------------------------------------------------------------------------------
    def _load(self) -> _Mirror:
        """The mirror from Redis; a malformed entry is skipped and counted, never a crash at every restart."""
        m, skipped = _Mirror(), 0
        meta = {k.decode(errors="replace"): v.decode(errors="replace")
                for k, v in self.client.hgetall(self._key("meta")).items()}  # fmt: skip
        try:
            m.step, m.next_gid = int(meta.get("step", 0)), int(meta.get("next_gid", 0))
            registration = parse_json(meta.get("registration", "{}"))
            if not isinstance(registration, dict) or (
                meta.get("registered") == "1" and "batch_size" not in registration
            ):
                raise ValueError("not a registration")
            m.registration = registration
            m.registered, m.started = meta.get("registered") == "1", meta.get("started") == "1"
        except ValueError:  # the trainer registers again (it does at every start)
            skipped += 1
            m.registered, m.started, m.registration = False, False, {}
            log.error("atropos state %s is malformed: the trainer must register again", self._key("meta"))
        for name in COUNTERS:
            with contextlib.suppress(ValueError):  # a counter something else overwrote starts again from 0
                m.counters[name] = int(meta.get(name, 0))
        # each list is read whole; one holding a malformed entry is written back without it (an env's entry as
        # a disconnected placeholder, so that ids stay), so every bad record is counted once
        repaired: dict[str, list[str]] = {}

        def read(
            key: str, decode: Callable[[Any], Any], placeholder: Callable[[int], Any] | None = None
        ) -> list[Any]:
            nonlocal skipped
            out, bad = [], False
            for raw in self.client.lrange(key, 0, -1):
                try:
                    out.append(decode(parse_json(raw)))
                except (ValueError, TypeError):
                    skipped, bad = skipped + 1, True
                    if placeholder is not None:
                        out.append(placeholder(len(out)))
            if bad:
                repaired[key] = [json.dumps(_fields(item)) for item in out]
            return out

        m.envs = read(self._key("envs"), lambda f: EnvEntry(**f),
                      lambda i: EnvEntry(0, 0.0, "", "", i, 0.0, False, None, 1))  # fmt: skip
        m.queue = read(self._key("queue"), _Entry.decode)
        for env in range(len(m.envs)):
            if buffered := read(self._key("buffer", str(env)), _Entry.decode):
                m.buffers[env] = buffered
        m.pending = read(self._key("pending"), lambda batch: [_Entry.decode(fields) for fields in batch])
        m.remember(
            [d.decode(errors="replace") for d in reversed(self.client.lrange(self._key("digests"), 0, -1))],
            self.dedup_window,
        )
        if skipped:
            m.counters["records_skipped"] += skipped
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hincrby(self._key("meta"), "records_skipped", skipped)
                for key, items in repaired.items():
                    pipe.delete(key)
                    if items:
                        pipe.rpush(key, *items)
                pipe.execute()
            log.warning("skipped %d malformed atropos records in Redis", skipped)
        return m

    # registration ------------------------------------------------------------------------------------------
    def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        m = self.fresh()
        if not m.registered:  # a later trainer's registration changes nothing, as in the reference
            self.client.hset(self._key("meta"), mapping={"registered": 1, "started": 0, "step": registration["starting_step"],
                                                         "registration": json.dumps(registration)})  # fmt: skip
            m.registered, m.started, m.step, m.registration = (
                True,
                False,
                registration["starting_step"],
                registration,
            )
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
        return {"status": "success", "env_id": entry.registered_id, "wandb_name": entry.real_name,
                "checkpoint_dir": r.get("checkpoint_dir", ""), "starting_step": m.step,
                "checkpoint_interval": r.get("save_checkpoint_interval"), "num_steps": r.get("num_steps")}  # fmt: skip

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
    def post(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Queue (or buffer) each group; the reference's answer for each. QueueFull before any change when
        the new groups would pass the bound; a group seen among the latest is answered, not queued again."""
        m = self.fresh()
        digests = [_digest(g) for g in groups]
        new = {d: g for g, d in zip(groups, digests, strict=True) if d not in m.digest_set}
        incoming = sum(len(g["tokens"]) for g in new.values())
        if new and m.queued_sequences() + incoming > self.max_queue_sequences:
            self.client.hincrby(self._key("meta"), "groups_refused_full", len(new))
            m.counters["groups_refused_full"] += len(new)
            raise QueueFull(f"the queue holds {m.queued_sequences()} sequences, at most "
                            f"{self.max_queue_sequences} (atropos.max_queue_sequences): retry later")  # fmt: skip
        queue, buffers, gid = list(m.queue), {k: list(v) for k, v in m.buffers.items()}, m.next_gid
        bodies: dict[int, dict[str, Any]] = {}
        touched: set[int] = set()
        latest: int | None = None
        answers: list[dict[str, Any]] = []
        for group, digest in zip(groups, digests, strict=True):
            if digest not in new:  # a retry of a group queued before, or twice in this request
                answers.append({"status": "received"})
                continue
            del new[digest]
            entry = _Entry(gid, len(group["tokens"]), group.get("env_id"))
            bodies[gid], gid = group, gid + 1
            env_id = entry.env_id
            if env_id is None or not 0 <= env_id < len(m.envs) or entry.size == m.envs[env_id].group_size:
                queue.append(entry)
                latest = entry.gid
                answers.append({"status": "received"})
                continue
            buffer = buffers.setdefault(env_id, [])  # an odd-sized group waits for others to sum up
            buffer.append(entry)
            chosen = summing_to([e.size for e in buffer], m.envs[env_id].group_size)
            queue += [buffer[i] for i in chosen]
            latest = buffer[chosen[-1]].gid if chosen else latest
            buffers[env_id] = [e for i, e in enumerate(buffer) if i not in set(chosen)]
            touched.add(env_id)
            answers.append({"status": "buffered", "buffer_size": sum(e.size for e in buffers[env_id])})
        fresh = list(dict.fromkeys(d for d in digests if d not in m.digest_set))
        duplicates = len(groups) - len(bodies)
        buffered = sum(a["status"] == "buffered" for a in answers)
        latest_body = bodies.get(latest) if latest is not None else None
        if latest is not None and latest_body is None:  # a group buffered by an earlier request
            latest_body = parse_json(self.client.hget(self._key("groups"), str(latest)) or b"null")
        with self.client.pipeline(transaction=True) as pipe:
            if bodies:
                pipe.hset(self._key("groups"), mapping={str(k): json.dumps(v) for k, v in bodies.items()})
            if len(queue) > len(m.queue):
                pipe.rpush(self._key("queue"), *(e.encode() for e in queue[len(m.queue) :]))
            for env_id in touched:
                pipe.delete(self._key("buffer", str(env_id)))
                if buffers[env_id]:
                    pipe.rpush(self._key("buffer", str(env_id)), *(e.encode() for e in buffers[env_id]))
            if latest_body is not None:
                pipe.set(self._key("latest"), json.dumps(latest_body))
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
        formed: list[list[_Entry]] = []
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
        if raw is None:
            return {"tokens": [], "masks": [], "scores": [], "advantages": [], "ref_logprobs": [],
                    "generation_params": [], "inference_logprobs": [], "messages": [], "images": []}  # fmt: skip
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
        answer, group_size = env_status([Queued(e.size, e.env_id) for e in m.queue], m.envs, env_id, m.step,
                                        m.registration.get("batch_size", 0))  # fmt: skip
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
        self.state = _Mirror()

    def figures(self) -> dict[str, Any]:
        """For the status and the registry (the heartbeat thread): read only, never a reload."""
        m = self.state
        return {**m.counters, "step": m.step, "queue_groups": len(m.queue), "queue_sequences": m.queued_sequences(),
                "pending_batches": len(m.pending), "envs_registered": len(m.envs),
                "envs_connected": sum(e.connected for e in m.envs)}  # fmt: skip
