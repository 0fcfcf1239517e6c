"""The experience stream: rollouts append trajectory chunks, the trainer consumes them.

The stream is bounded (XADD MAXLEN): a trainer that is slow or down never makes Redis grow; the chunks the
bound pushes out are counted, in the same atomic script that appends, together with env steps and episodes.
The trainer deletes what it has read, so the stream holds exactly the chunks not yet consumed. Each entry
has the field ``record``, an ``ExperienceRecord`` (``protocol/trajectory.py``), and in a run with a token the
field ``sig``, its HMAC under a key derived from the token (``security.signing_key``): a reader with the key
rejects an entry without it or with a wrong one, so a process with Redis access alone cannot inject experience.

An append is idempotent. The client resends a command whose answer it did not get in time (a Redis stalled past
the socket timeout), and Redis may then run both the command it had already received and the copy: the record
would reach the trainer twice and be counted as replayed, an attack where there is none. So each append carries
a number of its writer's, and the script appends a number it has seen before only once: the copy is dropped and
counted (``chunks_duplicate_retried``). The reader cannot tell a retry from a replay (both are the same signed
bytes): every duplicate it still sees came from outside.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from tinker_atropos.protocol.trajectory import RecordError
from tinker_atropos.security import signature, signed_by
from tinker_atropos.state import keys
from tinker_atropos.state.records import parse_json

MAX_EPISODES_KEPT = 1000
APPENDS_REMEMBERED = 1024  # per writer: far more than its sessions have in flight while one is retried
APPENDS_REMEMBERED_MS = 600_000  # a writer's numbers outlive the retries of its last append by far

RECORD_FIELD = b"record"  # a serialized ExperienceRecord
SIGNATURE_FIELD = b"sig"  # its HMAC, in a run with a token

# Every counter is added to through this: a field that is not an integer (written by something else) would make
# HINCRBY fail on every chunk and wedge collection, so it restarts from the increment and the repair is counted.
_ADD_COUNTER = """
local function add(key, field, n)
  local reply = redis.pcall('HINCRBY', key, field, n)
  if type(reply) == 'table' and reply.err then
    redis.call('HSET', key, field, n)
    redis.pcall('HINCRBY', key, 'counters_repaired', 1)
  end
end
"""

# KEYS: stream, stats, episodes, the writer's append numbers.  ARGV: bound, record, signature ('' unsigned),
# env steps, episodes kept, episodes cut by a non-finite value, append number, numbers kept, their life in ms,
# episode JSON...
_APPEND = (
    _ADD_COUNTER
    + """
local queued = redis.call('XLEN', KEYS[1])
if redis.call('ZADD', KEYS[4], 'NX', ARGV[7], ARGV[7]) == 0 then
  add(KEYS[2], 'chunks_duplicate_retried', 1)
  return queued
end
redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -1 - tonumber(ARGV[8]))
redis.call('PEXPIRE', KEYS[4], ARGV[9])
local bound = tonumber(ARGV[1])
if ARGV[3] == '' then
  redis.call('XADD', KEYS[1], 'MAXLEN', bound, '*', 'record', ARGV[2])
else
  redis.call('XADD', KEYS[1], 'MAXLEN', bound, '*', 'record', ARGV[2], 'sig', ARGV[3])
end
add(KEYS[2], 'chunks_written', 1)
add(KEYS[2], 'env_steps', ARGV[4])
if queued >= bound then
  add(KEYS[2], 'chunks_dropped_backpressure', queued - bound + 1)
end
if tonumber(ARGV[6]) > 0 then
  add(KEYS[2], 'episodes_cut_nonfinite', ARGV[6])
end
if #ARGV > 9 then
  redis.call('LPUSH', KEYS[3], unpack(ARGV, 10))
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[5]) - 1)
  add(KEYS[2], 'episodes', #ARGV - 9)
end
return queued
"""
)

# KEYS: stats.  ARGV: field, increment, field, increment, ...
_ADD_STATS = (
    _ADD_COUNTER
    + """
for i = 1, #ARGV, 2 do
  add(KEYS[1], ARGV[i], ARGV[i + 1])
end
"""
)


class ExperienceWriter:
    """Appends records, signed with ``key`` (the run's ``security.signing_key("experience")``) when given, and
    numbers them (``next_sequence``) for the records' ``sequence``: a reader takes each number once."""

    def __init__(
        self, client: redis.Redis, run: str, max_queued_chunks: int, key: bytes | None = None
    ) -> None:
        appended = keys.appended(run, uuid.uuid4().hex)
        self._keys = [keys.experience(run), keys.stats(run), keys.episodes(run), appended]
        self._bound = max_queued_chunks
        self._client = client
        self._append = client.register_script(_APPEND)
        self._key = key
        self._sequence = itertools.count(1)
        self._appends = itertools.count(1)  # what makes a retried append known to the script

    def next_sequence(self) -> int:
        """The number of the next record, for any of the threads that share this writer (atomic under the GIL)."""
        return next(self._sequence)

    def queued(self) -> int:
        return int(self._client.xlen(self._keys[0]))

    def append(
        self, record: bytes, env_steps: int, episodes: Sequence[dict[str, Any]] = (), cut_nonfinite: int = 0
    ) -> int:
        """Append one serialized record; returns how many were queued before it. ``episodes`` are the
        episodes that ended in it, ``cut_nonfinite`` how many of them a NaN or infinity ended."""
        args = [
            self._bound,
            record,
            signature(self._key, record) if self._key else b"",
            env_steps,
            MAX_EPISODES_KEPT,
            cut_nonfinite,
            next(self._appends),
            APPENDS_REMEMBERED,
            APPENDS_REMEMBERED_MS,
            *(json.dumps(e) for e in episodes),
        ]
        return int(self._append(keys=self._keys, args=args))


class ExperienceReader:
    """Takes records off the stream; with ``key``, only those signed with it."""

    def __init__(self, client: redis.Redis, run: str, key: bytes | None = None) -> None:
        self._client, self._stream, self._key = client, keys.experience(run), key

    def take(self, count: int, block_ms: int) -> list[bytes | RecordError]:
        """Up to ``count`` of the oldest queued records, waiting up to ``block_ms`` for the first; removes
        them. An entry without its record field, or not signed with the run's key, comes back as the
        RecordError to count it under."""
        reply = self._client.xread({self._stream: "0-0"}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1]
        self._client.xdel(self._stream, *(entry_id for entry_id, _ in entries))
        return [_record(fields, self._key) for _, fields in entries]


def _record(fields: dict[bytes, bytes], key: bytes | None) -> bytes | RecordError:
    if RECORD_FIELD in fields:
        record = fields[RECORD_FIELD]
        if key is None or signed_by(key, fields.get(SIGNATURE_FIELD), record):
            return record
        if SIGNATURE_FIELD not in fields:
            return RecordError("unsigned", "an entry without the run's signature (written without its token)")
        return RecordError("bad_signature", "an entry whose signature is not the run's (another token)")
    if b"chunk" in fields:
        return RecordError("schema_version", "an entry of the layout before schema 1 (field 'chunk')")
    names = ", ".join(repr(name.decode(errors="replace")) for name in fields) or "none"
    return RecordError("missing_field", f"an entry without its 'record' field (fields: {names})")


def queued_chunks(client: redis.Redis, run: str) -> int:
    return int(client.xlen(keys.experience(run)))


def read_stats(client: redis.Redis, run: str) -> dict[str, int]:
    """The run's counters; a field that is not an integer (written by something else) is left out."""
    stats = {}
    for name, value in client.hgetall(keys.stats(run)).items():
        with contextlib.suppress(ValueError):
            stats[name.decode(errors="replace")] = int(value)
    return stats


def add_stats(client: redis.Redis, run: str, **counts: int) -> None:
    """Add to the run's counters in one round trip (a field that is not an integer is repaired, counted)."""
    args = [item for name, n in counts.items() if n for item in (name, n)]
    if args:
        client.register_script(_ADD_STATS)(keys=[keys.stats(run)], args=args)


def recent_episodes(client: redis.Redis, run: str, n: int) -> list[dict[str, float]]:
    """The latest ``n`` finished episodes, newest first; an entry that is not an episode record is left out."""
    episodes = []
    for entry in client.lrange(keys.episodes(run), 0, n - 1):
        try:
            episode = parse_json(entry)
            episodes.append({"return": float(episode["return"]), "length": int(episode["length"])})
        except (ValueError, TypeError, KeyError):
            continue
    return episodes
