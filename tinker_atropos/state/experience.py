"""The experience stream: rollouts append trajectory chunks, the trainer consumes them.

The stream is bounded (XADD MAXLEN): a trainer that is slow or down never makes Redis grow; the chunks the
bound pushes out are counted, in the same atomic script that appends, together with env steps and episodes.
The trainer deletes what it has read, so the stream holds exactly the chunks not yet consumed. Each entry
has one field, ``record``: an ``ExperienceRecord`` (``protocol/trajectory.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import redis

from tinker_atropos.protocol.trajectory import RecordError
from tinker_atropos.state import keys

MAX_EPISODES_KEPT = 1000

RECORD_FIELD = b"record"  # the one field of a stream entry: a serialized ExperienceRecord

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

# KEYS: stream, stats, episodes.  ARGV: bound, record, env steps, episodes kept, episodes cut by a non-finite
# value, episode JSON...
_APPEND = (
    _ADD_COUNTER
    + """
local queued = redis.call('XLEN', KEYS[1])
local bound = tonumber(ARGV[1])
redis.call('XADD', KEYS[1], 'MAXLEN', bound, '*', 'record', ARGV[2])
add(KEYS[2], 'chunks_written', 1)
add(KEYS[2], 'env_steps', ARGV[3])
if queued >= bound then
  add(KEYS[2], 'chunks_dropped_backpressure', queued - bound + 1)
end
if tonumber(ARGV[5]) > 0 then
  add(KEYS[2], 'episodes_cut_nonfinite', ARGV[5])
end
if #ARGV > 5 then
  redis.call('LPUSH', KEYS[3], unpack(ARGV, 6))
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
  add(KEYS[2], 'episodes', #ARGV - 5)
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
    def __init__(self, client: redis.Redis, run: str, max_queued_chunks: int) -> None:
        self._keys = [keys.experience(run), keys.stats(run), keys.episodes(run)]
        self._bound = max_queued_chunks
        self._client = client
        self._append = client.register_script(_APPEND)

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
            env_steps,
            MAX_EPISODES_KEPT,
            cut_nonfinite,
            *(json.dumps(e) for e in episodes),
        ]
        return int(self._append(keys=self._keys, args=args))


class ExperienceReader:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self._client, self._key = client, keys.experience(run)

    def take(self, count: int, block_ms: int) -> list[bytes | RecordError]:
        """Up to ``count`` of the oldest queued records, waiting up to ``block_ms`` for the first; removes
        them. An entry without its record field comes back as the RecordError to count it under."""
        reply = self._client.xread({self._key: "0-0"}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1]
        self._client.xdel(self._key, *(entry_id for entry_id, _ in entries))
        return [_record(fields) for _, fields in entries]


def _record(fields: dict[bytes, bytes]) -> bytes | RecordError:
    if RECORD_FIELD in fields:
        return fields[RECORD_FIELD]
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
            episode = json.loads(entry)
            episodes.append({"return": float(episode["return"]), "length": int(episode["length"])})
        except (ValueError, TypeError, KeyError):
            continue
    return episodes
