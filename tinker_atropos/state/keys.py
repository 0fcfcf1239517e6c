"""The Redis key layout, versioned with the protocol. Every key of a run lives under ``ta:{run}:``."""

from __future__ import annotations

LAYOUT_VERSION = 1


def run_pattern(run: str) -> str:
    """Every key of ``run``."""
    return f"ta:{run}:*"


def service(run: str, kind: str, incarnation: str) -> str:
    """Hash with a TTL: one live service instance (registry entry)."""
    return f"ta:{run}:service:{kind}:{incarnation}"


def service_pattern(run: str, kind: str | None = None) -> str:
    return f"ta:{run}:service:{kind or '*'}:*"


def starts(run: str) -> str:
    """Hash service name -> how many incarnations it has had (restarts seen = starts - 1)."""
    return f"ta:{run}:starts"


def weights(run: str) -> str:
    """Hash {version, blob, spec, published_at}: the latest policy published by the trainer."""
    return f"ta:{run}:weights"


def weights_staging(run: str) -> str:
    """Hash: a record being published, renamed to ``weights`` within the transaction that wrote it (or deleted)."""
    return f"ta:{run}:weights:staging"


def weights_channel(run: str) -> str:
    """Pub/sub channel announcing each new weights version."""
    return f"ta:{run}:weights:published"


def experience(run: str) -> str:
    """Bounded stream of ExperienceRecord messages (field ``record``), rollout -> trainer."""
    return f"ta:{run}:experience"


def appended(run: str, writer: str) -> str:
    """Sorted set with a TTL: the latest numbers of the appends of one experience writer (random per writer), so
    that an append a client retried after Redis had taken it is not appended twice."""
    return f"ta:{run}:appended:{writer}"


def stats(run: str) -> str:
    """Hash of run-wide counters (env steps, chunks written/dropped/rejected, episodes)."""
    return f"ta:{run}:stats"


def episodes(run: str) -> str:
    """Capped list of the latest finished episodes, as JSON, newest first."""
    return f"ta:{run}:episodes"


def reporter_marker(run: str) -> str:
    """Set by `up`'s reporter: gone after a restart of Redis that lost its data, so the counters are restored."""
    return f"ta:{run}:reporter"


def member(run: str, kind: str, incarnation: str) -> str:
    """String with a short TTL (``rollout.lease_ttl_s``): one live member of the group that shares work, as JSON
    {run, incarnation, host}. Its expiry, faster than the registry's, is how the others learn of a death."""
    return f"ta:{run}:member:{kind}:{incarnation}"


def members(run: str, kind: str) -> str:
    """Set of the incarnations that wrote a ``member`` record: read without SCAN, pruned of those whose record
    expired."""
    return f"ta:{run}:members:{kind}"


def lease(run: str, unit: str) -> str:
    """String with a short TTL: the one rollout that may act on a unit of work (an env service's session slot,
    ``{env incarnation}:{slot}``), as JSON {run, unit, holder}."""
    return f"ta:{run}:lease:{unit}"


def tinker(run: str) -> str:
    """Prefix of the Tinker API's keys (``tinker_api/store/``: sessions, models, requests and their futures,
    samplers, training runs and their checkpoints, the samplers' record), each named there under it."""
    return f"ta:{run}:tinker"


def atropos(run: str) -> str:
    """Prefix of the Atropos trajectory API's keys (``frontends/atropos/``: its queue, buffer and groups, the envs
    registered, their digests), each named there under it."""
    return f"ta:{run}:atropos"


def under(prefix: str, *parts: str) -> str:
    """The key ``parts`` name under ``prefix`` (``tinker``, ``atropos``; a part may be a pattern's ``*``): the one
    place, with the prefixes above, that spells the layout's separator for the front-ends' own keys."""
    return ":".join((prefix, *parts))
