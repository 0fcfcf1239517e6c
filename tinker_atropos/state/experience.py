"""The experience stream: rollouts append trajectory chunks, the trainer consumes them.

The stream is bounded (XADD MAXLEN): a trainer that is slow or down never makes Redis grow; the chunks the
bound pushes out are counted, in the same atomic script that appends, together with env steps and episodes.
The trainer deletes what it has read, so the stream holds exactly the chunks not yet consumed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import redis

from tinker_atropos.state import keys

MAX_EPISODES_KEPT = 1000

# KEYS: stream, stats, episodes.  ARGV: bound, chunk, env steps, episodes kept, episode JSON...
_APPEND = """
local queued = redis.call('XLEN', KEYS[1])
local bound = tonumber(ARGV[1])
redis.call('XADD', KEYS[1], 'MAXLEN', bound, '*', 'chunk', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'chunks_written', 1)
redis.call('HINCRBY', KEYS[2], 'env_steps', ARGV[3])
if queued >= bound then
  redis.call('HINCRBY', KEYS[2], 'chunks_dropped_backpressure', queued - bound + 1)
end
if #ARGV > 4 then
  redis.call('LPUSH', KEYS[3], unpack(ARGV, 5))
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
  redis.call('HINCRBY', KEYS[2], 'episodes', #ARGV - 4)
end
return queued
"""


class ExperienceWriter:
    def __init__(self, client: redis.Redis, run: str, max_queued_chunks: int) -> None:
        self._keys = [keys.experience(run), keys.stats(run), keys.episodes(run)]
        self._bound = max_queued_chunks
        self._client = client
        self._append = client.register_script(_APPEND)

    def queued(self) -> int:
        return int(self._client.xlen(self._keys[0]))

    def append(self, chunk: bytes, env_steps: int, episodes: Sequence[dict[str, float]] = ()) -> int:
        """Append one serialized chunk; returns how many chunks were queued before it."""
        args = [self._bound, chunk, env_steps, MAX_EPISODES_KEPT, *(json.dumps(e) for e in episodes)]
        return int(self._append(keys=self._keys, args=args))


class ExperienceReader:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self._client, self._key = client, keys.experience(run)

    def take(self, count: int, block_ms: int) -> list[bytes]:
        """Up to ``count`` of the oldest queued chunks, waiting up to ``block_ms`` for the first; removes them."""
        reply = self._client.xread({self._key: "0-0"}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1]
        self._client.xdel(self._key, *(entry_id for entry_id, _ in entries))
        return [fields[b"chunk"] for _, fields in entries]


def queued_chunks(client: redis.Redis, run: str) -> int:
    return int(client.xlen(keys.experience(run)))


def read_stats(client: redis.Redis, run: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(keys.stats(run)).items()}


def add_stats(client: redis.Redis, run: str, **counts: int) -> None:
    with client.pipeline(transaction=False) as pipe:
        for name, n in counts.items():
            if n:
                pipe.hincrby(keys.stats(run), name, n)
        pipe.execute()


def recent_episodes(client: redis.Redis, run: str, n: int) -> list[dict[str, float]]:
    return [json.loads(e) for e in client.lrange(keys.episodes(run), 0, n - 1)]
