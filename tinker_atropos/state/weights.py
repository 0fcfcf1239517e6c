"""Versioned policy weights: the trainer publishes, rollouts pull when the version changes.

Version, blob and model spec are written in one HSET so a reader never sees a blob of another version. The
record carries the blob's SHA-256 (``digest``), checked before anything loads it, and in a run with a token an
HMAC of version, spec and digest under a key derived from the token (``sig``): a process with Redis access alone
cannot replace the weights the rollouts act with. The version is signed with the rest, so an older record written
back is still the trainer's: a rollout refuses any version below the one it acts with (``rollout/policy.py``).
Every driver publishes here (the experience loop, a Tinker-driven policy): the version is allocated in Redis, so
that it only rises whoever publishes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from tinker_atropos.security import signature, signed_by
from tinker_atropos.state import keys
from tinker_atropos.state.records import parse_json


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    blob: bytes
    spec: dict[str, Any]  # what a rollout needs to build the network: sizes, action kind, …


# The record is written only above the version Redis holds, or at it for the very same weights (a trainer
# publishing its version again after Redis lost or missed it): two publishers (the experience loop and a
# Tinker-driven policy) can neither make the version go down nor give two policies one number. The record is
# written to a staging key in the same transaction and renamed into place (the blob never passes through Lua,
# which would copy it twice). Returns -1 when published, else the version held, for the caller to sign the next
# one above it.
_PUBLISH = """
local held, digest, spec = unpack(redis.call('HMGET', KEYS[1], 'version', 'digest', 'spec'))
held = tonumber(held)
local version = tonumber(ARGV[1])
if held and (held > version or (held == version and (digest ~= ARGV[2] or spec ~= ARGV[3]))) then
  redis.call('DEL', KEYS[2])
  return held
end
redis.call('RENAME', KEYS[2], KEYS[1])
redis.call('PUBLISH', ARGV[4], ARGV[1])
return -1
"""


def publish_weights(
    client: redis.Redis, run: str, version: int, blob: bytes, spec: dict[str, Any], key: bytes | None = None
) -> int:
    """Publish the weights as ``version``, or as the next version above the one Redis holds if that is not
    lower, signed with ``key`` (the run's ``security.signing_key("weights")``) when given; the version published.
    One round trip, unless another publisher got there first."""
    spec_json, digest = json.dumps(spec), hashlib.sha256(blob).hexdigest()
    staging = keys.weights_staging(run)
    while True:
        mapping: dict[str, Any] = {
            "version": version,
            "blob": blob,
            "spec": spec_json,
            "digest": digest,
            "published_at": time.time(),
        }
        if key is not None:
            mapping["sig"] = signature(key, str(version).encode(), spec_json.encode(), digest.encode())
        with client.pipeline(transaction=True) as pipe:
            pipe.delete(staging)
            pipe.hset(staging, mapping=mapping)
            # EVAL, not EVALSHA: a pipeline would ask SCRIPT EXISTS first, a round trip more
            pipe.eval(
                _PUBLISH, 2, keys.weights(run), staging, version, digest, spec_json, keys.weights_channel(run)
            )
            held = int(pipe.execute()[-1])
        if held < 0:
            return version
        version = held + 1


class WeightsRecordError(ValueError):
    """The weights hash holds something the trainer did not write (a version that is no integer, a spec that
    is no JSON object, no blob, no or another signature), or an older version than the reader holds; ``reason``
    names what it is counted under."""

    REASONS = ("malformed", "unsigned", "bad_signature", "rolled_back")

    def __init__(self, message: str, reason: str = "malformed") -> None:
        assert reason in self.REASONS, reason
        super().__init__(message)
        self.reason = reason


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


def _check_signature(
    version: bytes, spec: bytes | None, digest: bytes | None, sig: bytes | None, key: bytes | None
) -> None:
    if spec is None or digest is None:
        raise WeightsRecordError("a weights record without its spec or digest")
    if key is not None and not signed_by(key, sig, version, spec, digest):
        if sig is None:
            raise WeightsRecordError("a weights record without the run's signature", "unsigned")
        raise WeightsRecordError("a weights record signed with another token", "bad_signature")


def verified_version(client: redis.Redis, run: str, key: bytes | None = None) -> int | None:
    """The published version if the record is the trainer's (signed with ``key``, when given), read without
    its blob; WeightsRecordError otherwise. How the trainer notices weights it must publish over."""
    version, spec, digest, sig = client.hmget(keys.weights(run), ["version", "spec", "digest", "sig"])
    if version is None:
        return None
    _check_signature(version, spec, digest, sig, key)
    return _version(version)


def fetch_weights(client: redis.Redis, run: str, key: bytes | None = None) -> PublishedWeights | None:
    """The published weights, None before any; WeightsRecordError for a malformed record, a blob that does not
    match its digest, or (with ``key``) a record not signed with it. The blob's contents are
    checked where it is loaded, ``weights_from_bytes``."""
    fields = ["version", "blob", "spec", "digest", "sig"]
    version, blob, spec, digest, sig = client.hmget(keys.weights(run), fields)
    if version is None:
        return None
    if blob is None:
        raise WeightsRecordError("a weights record without its blob")
    _check_signature(version, spec, digest, sig, key)
    assert spec is not None and digest is not None
    if not hmac.compare_digest(hashlib.sha256(blob).hexdigest().encode(), digest):
        raise WeightsRecordError("a weights blob that does not match its digest")
    try:
        parsed = parse_json(spec)
    except ValueError as error:
        raise WeightsRecordError(f"a weights spec that is not JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise WeightsRecordError(f"a weights spec that is not a JSON object ({type(parsed).__name__})")
    return PublishedWeights(_version(version), blob, parsed)
