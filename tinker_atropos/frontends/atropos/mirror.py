"""The trajectory API's state in memory, mirrored from Redis: the queue, the env buffers, the batches formed, the
registrations and counters; how it is read back (repairing what is malformed) and where a post's groups go. The
store (``store.py``) writes each change to Redis first and applies it here once Redis took it."""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from tinker_atropos.frontends.atropos.packing import EnvEntry, summing_to
from tinker_atropos.state.records import parse_json

log = logging.getLogger(__name__)

COUNTERS = (
    "groups_received",
    "groups_buffered",
    "groups_refused_full",
    "groups_duplicate",
    "batches_served",
    "sequences_served",
    "records_skipped",
    "groups_refused_invalid",
)


@dataclass
class Entry:
    """A queued or buffered group: its id in ``groups`` and what the packing needs."""

    gid: int
    size: int
    env_id: int | None

    def encode(self) -> str:
        return json.dumps(self.fields())

    def fields(self) -> list[int | None]:
        return [self.gid, self.size, self.env_id]

    @classmethod
    def decode(cls, fields: Any) -> Entry:
        """ValueError or TypeError for anything but [gid, size, env_id]."""
        gid, size, env_id = fields
        return cls(int(gid), int(size), None if env_id is None else int(env_id))


@dataclass
class Mirror:
    """The state in memory, for the packing maths: changed only once Redis took the change."""

    registered: bool = False
    started: bool = False
    registration: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    next_gid: int = 0
    envs: list[EnvEntry] = field(default_factory=list)
    queue: list[Entry] = field(default_factory=list)
    buffers: dict[int, list[Entry]] = field(default_factory=dict)
    pending: list[list[Entry]] = field(default_factory=list)  # formed batches, served last first
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
    if isinstance(item, Entry):
        return item.fields()
    return [e.fields() for e in item]


def load(client: redis.Redis, key: Callable[..., str], dedup_window: int) -> Mirror:
    """The mirror read from Redis; a malformed entry is skipped and counted, never a crash at every restart."""
    m, skipped = Mirror(), 0
    meta = {
        k.decode(errors="replace"): v.decode(errors="replace") for k, v in client.hgetall(key("meta")).items()
    }
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
        log.error("atropos state %s is malformed: the trainer must register again", key("meta"))
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
        for raw in client.lrange(key, 0, -1):
            try:
                out.append(decode(parse_json(raw)))
            except (ValueError, TypeError):
                skipped, bad = skipped + 1, True
                if placeholder is not None:
                    out.append(placeholder(len(out)))
        if bad:
            repaired[key] = [json.dumps(_fields(item)) for item in out]
        return out

    m.envs = read(
        key("envs"), lambda f: EnvEntry(**f), lambda i: EnvEntry(0, 0.0, "", "", i, 0.0, False, None, 1)
    )
    m.queue = read(key("queue"), Entry.decode)
    for env in range(len(m.envs)):
        if buffered := read(key("buffer", str(env)), Entry.decode):
            m.buffers[env] = buffered
    m.pending = read(key("pending"), lambda batch: [Entry.decode(fields) for fields in batch])
    m.remember(
        [d.decode(errors="replace") for d in reversed(client.lrange(key("digests"), 0, -1))],
        dedup_window,
    )
    if skipped:
        m.counters["records_skipped"] += skipped
        with client.pipeline(transaction=True) as pipe:
            pipe.hincrby(key("meta"), "records_skipped", skipped)
            for key, items in repaired.items():
                pipe.delete(key)
                if items:
                    pipe.rpush(key, *items)
            pipe.execute()
        log.warning("skipped %d malformed atropos records in Redis", skipped)
    return m


@dataclass
class Placed:
    """Where a post's new groups go, before anything is written: the queue and buffers after it, the bodies to
    store by id, the buffers it changed, the latest group queued and the answer for each group."""

    queue: list[Entry]
    buffers: dict[int, list[Entry]]
    next_gid: int
    bodies: dict[int, dict[str, Any]]
    touched: set[int]
    latest: int | None
    answers: list[dict[str, Any]]


def place(
    m: Mirror, groups: list[dict[str, Any]], digests: list[str], new: dict[str, dict[str, Any]]
) -> Placed:
    """Each group of ``new`` (by digest) queued, or buffered with its env's odd-sized groups until some sum to the
    env's group size; any other (a retry, or twice in the request) only answered."""
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
        entry = Entry(gid, len(group["tokens"]), group.get("env_id"))
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
    return Placed(queue, buffers, gid, bodies, touched, latest, answers)
