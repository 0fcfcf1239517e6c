"""Versioned policy weights: the trainer publishes, rollouts pull when the version changes.

Version, blob and model spec are written in one HSET so a reader never sees a blob of another version.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from tinker_atropos.state import keys


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    blob: bytes
    spec: dict[str, Any]  # what a rollout needs to build the network: sizes, action kind, …


def publish_weights(client: redis.Redis, run: str, version: int, blob: bytes, spec: dict[str, Any]) -> None:
    mapping = {"version": version, "blob": blob, "spec": json.dumps(spec), "published_at": time.time()}
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.weights(run), mapping=mapping)
        pipe.publish(keys.weights_channel(run), version)
        pipe.execute()


def published_version(client: redis.Redis, run: str) -> int | None:
    """The latest published version: one cheap HGET, called between chunks."""
    raw = client.hget(keys.weights(run), "version")
    return None if raw is None else int(raw)


def fetch_weights(client: redis.Redis, run: str) -> PublishedWeights | None:
    version, blob, spec = client.hmget(keys.weights(run), ["version", "blob", "spec"])
    if version is None or blob is None:
        return None
    return PublishedWeights(int(version), blob, json.loads(spec))
