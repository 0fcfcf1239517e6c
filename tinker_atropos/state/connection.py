"""Redis clients: services ride out a Redis restart, commands that a person waits on fail fast in one line."""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class RedisUnreachable(Exception):
    """Redis did not answer within the time allowed; the message is one line with the URL and the cause."""


class SharedRetry(Retry):
    """One retry policy for all the connections of a client (redis-py copies it into each one otherwise), so
    that ``update_retries(0)`` reaches the commands in flight too."""

    def __deepcopy__(self, memo: dict) -> SharedRetry:
        return self


def connect(url: str) -> redis.Redis:
    """A client for ``url`` whose commands retry for about 5 s before raising: long enough to ride out a Redis
    restart unnoticed, short enough that a service whose Redis is gone still drains within seconds (its
    loops retry on their own, checking for SIGTERM in between)."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_keepalive=True,
        health_check_interval=10,
        retry=SharedRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=6),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def connect_fast(url: str) -> redis.Redis:
    """A client whose commands fail within about 2 s when Redis is away: for `status`, `up`'s reporter and
    reachability probes, where a person waits on the answer."""
    return redis.Redis.from_url(
        url, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(ExponentialBackoff(), 0)
    )


def describe(error: Exception) -> str:
    """A Redis error as one line."""
    return f"{type(error).__name__}: {error}".rstrip(".")


def wait_until_reachable(url: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
    """True once Redis at ``url`` answers a PING, False if ``stop`` is set first. The first failure is logged
    in one line at once; after ``timeout_s`` RedisUnreachable is raised."""
    probe = connect_fast(url)
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    reported = False
    try:
        while True:
            try:
                probe.ping()
                if reported:
                    log.info("Redis at %s answers", url)
                return True
            except redis.RedisError as error:
                cause = describe(error)
            if time.monotonic() >= deadline:
                raise RedisUnreachable(f"Redis at {url} unreachable for {timeout_s:g} s ({cause})")
            if not reported:
                log.warning("Redis at %s unreachable (%s); waiting up to %g s", url, cause, timeout_s)
                reported = True
            if stop.wait(PROBE_INTERVAL_S):
                return False
    finally:
        probe.close()


def connect_when_reachable(url: str, timeout_s: float, stop: threading.Event) -> redis.Redis | None:
    """``connect(url)`` once Redis answers, None if stopped first (see ``wait_until_reachable``): how a service
    starts. Once ``stop`` is set, the client's commands stop retrying, so a service draining while Redis is
    gone does not wait out its retries."""
    if not wait_until_reachable(url, timeout_s, stop):
        return None
    client = connect(url)

    def give_up_retrying() -> None:
        stop.wait()
        client.get_retry().update_retries(0)

    threading.Thread(target=give_up_retrying, name="redis-drain", daemon=True).start()
    return client
