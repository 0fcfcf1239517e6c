"""Redis clients that survive a Redis restart: every command retries with exponential backoff."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def connect(url: str) -> redis.Redis:
    """A client for ``url`` that retries for about half a minute before giving up on a command."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_keepalive=True,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=20),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
