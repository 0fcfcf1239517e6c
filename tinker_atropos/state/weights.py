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


class WeightsRecordError(ValueError):
    """The weights hash holds something the trainer did not write (a version that is no integer, a spec that
    is no JSON object, no blob)."""


def _version(raw: bytes) -> int:
    try:
        version = int(raw)
    except ValueError:
        raise WeightsRecordError(f"weights version {raw[:40]!r} is not an integer") from None
    if version < 0:
        raise WeightsRecordError(f"weights version {version} is negative")
    return version


def published_version(client: redis.Redis, run: str) -> int | None:
    """The latest published version: one cheap HGET, called between chunks. WeightsRecordError if malformed."""
    raw = client.hget(keys.weights(run), "version")
    return None if raw is None else _version(raw)


def fetch_weights(client: redis.Redis, run: str) -> PublishedWeights | None:
    """The published weights, None before any; WeightsRecordError for a malformed record (the blob itself is
    checked where it is loaded, ``weights_from_bytes``)."""
    version, blob, spec = client.hmget(keys.weights(run), ["version", "blob", "spec"])
    if version is None:
        return None
    if blob is None or spec is None:
        raise WeightsRecordError("a weights record without its blob or spec")
    try:
        parsed = json.loads(spec)
    except ValueError:
        raise WeightsRecordError("a weights spec that is not JSON") from None
    if not isinstance(parsed, dict):
        raise WeightsRecordError(f"a weights spec that is not a JSON object ({type(parsed).__name__})")
    return PublishedWeights(_version(version), blob, parsed)
