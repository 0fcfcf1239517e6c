"""Membership and leases in Redis: how rollouts know who is alive and which session slots each one acts on.

Each rollout writes a membership record (and its incarnation into the run's set of members, so that nobody needs
to SCAN for them) and one lease per slot it holds, all with a TTL of
``rollout.lease_ttl_s`` that it refreshes three times per TTL. A SIGKILLed rollout's records expire within that
TTL, so the others take its share over without waiting for the registry's longer one. A lease is taken with a
compare-and-set (absent, or exactly the stale record that was read), refreshed only while it is still the
holder's (or recreated where Redis lost it), and deleted only by its holder: two rollouts never hold one slot.

Anything read here may have been written by someone else: a record that does not parse, names another run, or
names a holder that is no live member is skipped and counted by reason, and a lease so skipped can be taken over.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from tinker_atropos.state import keys
from tinker_atropos.state.records import parse_json

KIND = "rollout"
SKIP_REASONS = ("malformed", "other_run", "dead_holder")

# KEYS[1] lease; ARGV: record, ttl ms, the record it replaces ('' for none)
_CLAIM = """
local current = redis.call('GET', KEYS[1])
if (not current and ARGV[3] == '') or current == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] lease; ARGV: record, ttl ms. Recreated where it is gone (a Redis that restarted without its data).
_REFRESH = """
local current = redis.call('GET', KEYS[1])
if not current or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] lease; ARGV[1] record
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Member:
    """One live rollout, as its membership record says."""

    incarnation: str
    host: str


@dataclass(frozen=True)
class LeaseView:
    """Who holds which unit, as read: ``held`` maps a unit to a live holder; ``stale`` maps a unit whose record
    was skipped to that record, which a claim must name to replace it."""

    held: dict[str, str]
    stale: dict[str, bytes]


class Leases:
    """One rollout's membership and leases, and its reading of everyone else's."""

    def __init__(self, client: redis.Redis, run: str, incarnation: str, host: str, ttl_s: float) -> None:
        self._client, self.run, self.incarnation, self.host = client, run, incarnation, host
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._member_key, self._members_key = keys.member(run, KIND, incarnation), keys.members(run, KIND)
        self._member_record = json.dumps({"run": run, "incarnation": incarnation, "host": host})
        self._claim = client.register_script(_CLAIM)
        self._refresh = client.register_script(_REFRESH)
        self._release = client.register_script(_RELEASE)
        self.skipped: Counter[str] = Counter()
        self._reported: set[bytes] = set()  # records already counted: a stale one is read again every tick
        self.held_until = 0.0  # monotonic time until which every lease this rollout refreshed last is its own

    def _record(self, unit: str) -> str:
        return json.dumps({"run": self.run, "unit": unit, "holder": self.incarnation})

    def _skip(self, reason: str, key: bytes, raw: bytes) -> None:
        if key + b"\0" + raw not in self._reported:
            if len(self._reported) > 10_000:  # bounded: a flood of bad records costs counts, not memory
                self._reported.clear()
            self._reported.add(key + b"\0" + raw)
            self.skipped[reason] += 1

    def _parse(self, key: bytes, raw: bytes, fields: Sequence[str]) -> dict[str, str] | None:
        """The record's fields, or None (counted) for one that is malformed or of another run."""
        try:
            record = parse_json(raw)
            if not isinstance(record, dict) or not all(isinstance(record.get(f), str) for f in fields):
                raise ValueError("not an object with string fields " + ", ".join(fields))
        except ValueError:
            self._skip("malformed", key, raw)
            return None
        if record["run"] != self.run:
            self._skip("other_run", key, raw)
            return None
        return record

    def members(self) -> list[Member]:
        """The live rollouts, this one always among them; incarnations whose record expired leave the set."""
        incarnations = sorted(self._client.smembers(self._members_key))
        names = [keys.member(self.run, KIND, i.decode(errors="replace")) for i in incarnations]
        found = {self.incarnation: Member(self.incarnation, self.host)}
        gone = []
        for incarnation, name, raw in zip(
            incarnations, names, self._client.mget(names) if names else [], strict=True
        ):
            if raw is None:  # its TTL ran out: a dead rollout
                gone.append(incarnation)
                continue
            record = self._parse(name.encode(), raw, ("run", "incarnation", "host"))
            if record is not None and name == keys.member(self.run, KIND, record["incarnation"]):
                found.setdefault(record["incarnation"], Member(record["incarnation"], record["host"]))
            elif record is not None:  # a member record under another member's name
                self._skip("malformed", name.encode(), raw)
        if gone:
            self._client.srem(self._members_key, *gone)
        return sorted(found.values(), key=lambda m: m.incarnation)

    def read(self, units: Iterable[str], live: set[str]) -> LeaseView:
        """The leases of ``units``, given the incarnations of the ``live`` members."""
        units = list(units)
        names = [keys.lease(self.run, unit) for unit in units]
        held, stale = {}, {}
        for unit, name, raw in zip(units, names, self._client.mget(names) if names else [], strict=True):
            if raw is None:
                continue
            record = self._parse(name.encode(), raw, ("run", "unit", "holder"))
            if record is not None and record["unit"] != unit:
                self._skip("malformed", name.encode(), raw)
                record = None
            if record is not None and record["holder"] not in live:
                self._skip("dead_holder", name.encode(), raw)
                record = None
            if record is None:
                stale[unit] = raw
            else:
                held[unit] = record["holder"]
        return LeaseView(held, stale)

    def claim(self, unit: str, replacing: bytes | None = None) -> bool:
        """Take ``unit``'s lease if it is free, or still holds exactly the skipped record ``replacing``."""
        args = [self._record(unit), self.ttl_ms, replacing if replacing is not None else ""]
        return bool(self._claim(keys=[keys.lease(self.run, unit)], args=args))

    def refresh(self, units: Iterable[str]) -> set[str]:
        """Extend the membership and the leases of ``units``; the units whose lease another rollout holds now
        (lost: act on them no more). Raises RedisError, leaving ``held_until`` where it was."""
        units = list(units)
        started = time.monotonic()
        with self._client.pipeline(transaction=False) as pipe:
            pipe.set(self._member_key, self._member_record, px=self.ttl_ms)
            pipe.sadd(self._members_key, self.incarnation)
            for unit in units:
                self._refresh(
                    keys=[keys.lease(self.run, unit)], args=[self._record(unit), self.ttl_ms], client=pipe
                )
            results = pipe.execute()[2:]
        self.held_until = started + self.ttl_ms / 1000
        return {unit for unit, kept in zip(units, results, strict=True) if not kept}

    def release(self, unit: str) -> None:
        """Delete ``unit``'s lease if it is still this rollout's."""
        self._release(keys=[keys.lease(self.run, unit)], args=[self._record(unit)])

    def leave(self, units: Iterable[str]) -> None:
        """Delete the leases of ``units`` and the membership: the others take the share over at once."""
        with self._client.pipeline(transaction=False) as pipe:
            for unit in units:
                self._release(keys=[keys.lease(self.run, unit)], args=[self._record(unit)], client=pipe)
            pipe.delete(self._member_key)
            pipe.srem(self._members_key, self.incarnation)
            pipe.execute()
