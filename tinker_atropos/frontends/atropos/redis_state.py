"""The trajectory API's state as Redis holds it and its process mirrors it: the client (sending large values whole),
the run's keys (``ta:{run}:atropos:…``), and the mirror, read back from Redis after a call that failed on it (its
change may be half-made in memory). The store's parts each read the mirror through ``fresh``."""

from __future__ import annotations

import redis
from redis.connection import PythonRespSerializer

from tinker_atropos.frontends.atropos.mirror import Mirror, load
from tinker_atropos.state import keys


class RedisState:
    """One run's keys in Redis and their mirror in memory, changed only once Redis took the change."""

    def __init__(self, client: redis.Redis, run: str, dedup_window: int) -> None:
        _sending_values_whole(client)
        self.client, self.prefix, self.dedup_window = client, keys.atropos(run), dedup_window
        self.stale = False  # a call failed on Redis (``read_back``): the next one reads the state back first
        self.mirror = load(client, self.key, dedup_window)

    def key(self, *parts: str) -> str:
        """The run's key that ``parts`` name under ``ta:{run}:atropos`` (``state.keys``: the layout is spelled there)."""
        return keys.under(self.prefix, *parts)

    def read_back(self) -> None:
        """A call failed on Redis: its change may be half-made in the mirror, which the next call reads back."""
        self.stale = True

    def fresh(self) -> Mirror:
        """The mirror, read back from Redis first if a request failed on it since."""
        if self.stale:
            self.mirror, self.stale = load(self.client, self.key, self.dedup_window), False
        return self.mirror

    def reset(self) -> None:
        """Every key of the run deleted, and the mirror empty."""
        found = list(self.client.scan_iter(match=self.key("*"), count=1000))
        if found:
            self.client.delete(*found)
        self.mirror = Mirror()


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
