"""The run's Tinker namespace in Redis, which every part of the store keys under."""

from __future__ import annotations

import redis

from tinker_atropos.state import keys


class Keys:
    """Keys under ``ta:{run}:tinker`` (``state.keys.tinker``)."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client, self.run, self.prefix = client, run, keys.tinker(run)

    def _key(self, *parts: str) -> str:
        return keys.under(self.prefix, *parts)
