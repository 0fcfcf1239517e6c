"""Redis clients: services ride out a Redis restart, commands that a person waits on fail fast in one line.

Credentials stay out of command lines and logs: the password comes from the URL or from the file named by
``TA_REDIS_PASSWORD_FILE``, the CA of a ``rediss://`` server from ``TA_REDIS_CA`` (or the URL's
``ssl_ca_certs``), and a URL is logged with its password masked (``masked``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
# how long a service's Redis command waits for its answer before it is sent again on a new connection (experience
# appends are idempotent for that: ``experience.py``): ten times the longest blocking read a service makes (an XREAD
# of the experience stream blocks 500 ms: ``trainer/experience_loop.py``, ``experience_source.py``), and short
# enough that a service draining while Redis hangs (no retries then) stops within `up`'s 10 s. Named here rather
# than left to redis-py's default (5 s in the pinned 8.1), which an upgrade could change under us
SOCKET_TIMEOUT_S = 5.0


class RedisUnreachable(Exception):
    """Redis did not answer within the time allowed; the message is one line with the URL and the cause."""


class SharedRetry(Retry):
    """One retry policy for all the connections of a client (redis-py copies it into each one otherwise), so
    that ``update_retries(0)`` reaches the commands in flight too."""

    def __deepcopy__(self, memo: dict) -> SharedRetry:
        return self


def check_url(url: str) -> None:
    """ValueError, saying why, for a URL the Redis client cannot connect with."""
    try:
        parse_url(url)
        urlsplit(url).port  # noqa: B018  (parse_url lets a port that is no number through)
    except ValueError as error:
        raise ValueError(
            f"not a Redis URL ({error}); e.g. redis://[:PASSWORD@]HOST:6379/0 or rediss://…"
        ) from None


def masked(url: str) -> str:
    """``url`` with its password replaced by ``***``: how a URL is printed or logged. One that does not parse
    is shown by its scheme alone: it may still hold a password."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return f"{url.partition(':')[0]}://(unparsable URL)"
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{port}" if port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def without_password(url: str) -> str:
    """``url`` with no password: what may be written down (``run.lock``) for others to connect with their own."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, address = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@{address}" if user else address))


def credentials(url: str) -> dict[str, Any]:
    """What a client for ``url`` needs beyond the URL: the password of ``TA_REDIS_PASSWORD_FILE`` when the URL
    has none, the CA of ``TA_REDIS_CA`` for ``rediss://``."""
    from tinker_atropos.errors import FatalError

    options: dict[str, Any] = {}
    parts = urlsplit(url)
    path = os.environ.get("TA_REDIS_PASSWORD_FILE")
    if path and parts.password is None:
        try:
            options["password"] = Path(path).read_text().strip()
        except OSError as error:
            raise FatalError(f"TA_REDIS_PASSWORD_FILE {path}: {error.strerror}") from None
    ca = os.environ.get("TA_REDIS_CA")
    if ca and parts.scheme == "rediss":
        options["ssl_ca_certs"] = ca
    return options


def connect(url: str) -> redis.Redis:
    """A client for ``url`` whose commands retry for about 5 s before raising: long enough to ride out a Redis
    restart unnoticed, short enough that a service whose Redis is gone still drains within seconds (its
    loops retry on their own, checking for SIGTERM in between). To a Redis that hangs, each try waits
    ``SOCKET_TIMEOUT_S``."""
    return redis.Redis.from_url(
        url,
        **credentials(url),
        socket_connect_timeout=2.0,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=10,
        retry=SharedRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=6),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def connect_fast(url: str) -> redis.Redis:
    """A client whose commands fail within about 2 s when Redis is away: for `status`, `up`'s reporter and
    reachability probes, where a person waits on the answer."""
    return redis.Redis.from_url(
        url,
        **credentials(url),
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry=Retry(ExponentialBackoff(), 0),
    )


def describe(error: Exception) -> str:
    """A Redis error as one line."""
    return " ".join(f"{type(error).__name__}: {error}".split()).rstrip(".")


def login_refused(url: str, error: redis.AuthenticationError) -> str:
    """One line on a login Redis refused, naming what to set: the password file of ``TA_REDIS_PASSWORD_FILE``
    (``up`` writes one per run, RUN_DIR/redis-password) or the URL's."""
    path = os.environ.get("TA_REDIS_PASSWORD_FILE")
    if urlsplit(url).password is not None:
        given = "the password in the URL"
    elif path:
        given = f"the password of TA_REDIS_PASSWORD_FILE {path}"
    else:
        return (
            f"Redis at {masked(url)} wants a password: set TA_REDIS_PASSWORD_FILE to the file that holds it "
            "(a run of `up` keeps it in RUN_DIR/redis-password) or put it in the URL (redis://:PASSWORD@HOST:PORT)"
        )
    return (
        f"Redis at {masked(url)} refused {given} ({describe(error)}): set TA_REDIS_PASSWORD_FILE to the run's "
        "password file (RUN_DIR/redis-password for a run of `up`)"
    )


def wait_until_reachable(url: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
    """True once Redis at ``url`` answers a PING, False if ``stop`` is set first. The first failure is logged
    in one line at once; after ``timeout_s`` RedisUnreachable is raised. A refused login is no outage: waiting
    would not help, so it raises FatalError at once, naming the password to set."""
    from tinker_atropos.errors import FatalError

    probe = connect_fast(url)
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    reported = False
    try:
        while True:
            try:
                probe.ping()
                if reported:
                    log.info("Redis at %s answers", masked(url))
                return True
            except redis.AuthenticationError as error:
                raise FatalError(login_refused(url, error)) from None
            except redis.RedisError as error:
                cause = describe(error)
            if time.monotonic() >= deadline:
                raise RedisUnreachable(f"Redis at {masked(url)} unreachable for {timeout_s:g} s ({cause})")
            if not reported:
                log.warning("Redis at %s unreachable (%s); waiting up to %g s", masked(url), cause, timeout_s)
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
