"""Service registry: each service writes who and where it is under a TTL and refreshes it (heartbeat).

Discovery reads the registry, never a hard-coded address; a service that stops heart-beating disappears
when its TTL runs out and is accepted back as soon as it beats again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from tinker_atropos.state import keys
from tinker_atropos.state.records import parse_json

log = logging.getLogger(__name__)

DEREGISTER_WAIT_S = 1.0
_reported_malformed: set[bytes] = set()  # registry keys whose malformed entry was already logged


@dataclass(frozen=True)
class ServiceRecord:
    kind: str
    address: str
    incarnation: str
    started_at: float
    heartbeat_at: float
    name: str = ""
    starts: int = 1
    figures: dict[str, Any] = field(default_factory=dict)
    host: str = ""  # ``processes.local_host_id``: equal for services that reach each other's local fast path

    @property
    def restarts(self) -> int:
        return self.starts - 1

    @property
    def heartbeat_age_s(self) -> float:
        return max(0.0, time.time() - self.heartbeat_at)


class Registration:
    """Keeps one service's registry entry alive from a background thread until ``close``."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        kind: str,
        address: str,
        incarnation: str,
        figures: Callable[[], dict[str, Any]],
        interval_s: float,
        ttl_s: float,
        name: str | None = None,
        host: str = "",
    ) -> None:
        self._client, self._figures = client, figures
        self._key = keys.service(run, kind, incarnation)
        self._starts_key = keys.starts(run)
        self._static: dict[str, Any] = {
            "kind": kind,
            "name": name or f"{kind}@{address}",
            "address": address,
            "incarnation": incarnation,
            "host": host,
            "started_at": time.time(),
            "layout": keys.LAYOUT_VERSION,  # lets a reader tell entries of another key-layout version
        }
        self._interval_s, self._ttl_ms = interval_s, int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{kind}", daemon=True)

    def start(self) -> Registration:
        self._static["starts"] = self._client.hincrby(self._starts_key, self._static["name"], 1)
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        entry = {**self._static, "heartbeat_at": time.time(), "figures": json.dumps(self._figures())}
        with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._key, mapping=entry)
            pipe.pexpire(self._key, self._ttl_ms)
            pipe.execute()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            # Redis away: the client's retries already backed off; the next beat re-registers
            with contextlib.suppress(redis.RedisError):
                self.beat()

    def close(self) -> None:
        """Stop beating and deregister, so discovery forgets this service at once. With Redis away this
        waits at most ``DEREGISTER_WAIT_S``: the TTL removes the entry anyway, and a drain must be quick."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=DEREGISTER_WAIT_S)

        def deregister() -> None:
            with contextlib.suppress(redis.RedisError):
                self._client.delete(self._key)

        leaving = threading.Thread(target=deregister, name="deregister", daemon=True)
        leaving.start()
        leaving.join(timeout=DEREGISTER_WAIT_S)


def live_services(client: redis.Redis, run: str, kind: str | None = None) -> list[ServiceRecord]:
    """Every service of ``run`` (of one ``kind`` if given) whose heartbeat has not expired."""
    names = sorted(client.scan_iter(match=keys.service_pattern(run, kind), count=500))
    if not names:
        return []
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(name)
        entries = pipe.execute()
    records = []
    for name, entry in zip(names, entries, strict=True):
        if not entry:  # expired between SCAN and HGETALL
            continue
        try:
            records.append(_parse_entry(entry))
        except (KeyError, ValueError, TypeError) as error:  # written by something else: not a service
            if name not in _reported_malformed:
                _reported_malformed.add(name)
                log.warning(
                    "skipping malformed registry entry %s: %s: %s",
                    name.decode(errors="replace"),
                    type(error).__name__,
                    error,
                )
    return records


def _parse_entry(entry: dict[bytes, bytes]) -> ServiceRecord:
    e = {k.decode(): v.decode() for k, v in entry.items()}
    figures = parse_json(e.get("figures") or "{}")
    if not isinstance(figures, dict):
        raise ValueError(f"figures must be a JSON object, got {type(figures).__name__}")
    return ServiceRecord(
        kind=e["kind"],
        address=e["address"],
        incarnation=e["incarnation"],
        started_at=float(e["started_at"]),
        heartbeat_at=float(e["heartbeat_at"]),
        name=e.get("name", ""),
        starts=int(e.get("starts", 1)),
        figures=figures,
        host=e.get("host", ""),
    )
