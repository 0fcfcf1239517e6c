"""What the HTTP front-ends share (Tinker API, Atropos trajectory API, inference endpoint): ASGI middleware for API
keys, the keys themselves, the threads their Redis calls run in (``RedisCalls``), the uvicorn thread they run in
and a client of the run's own services; what reading a body may cost is ``bodies.py``'s. Plain ASGI, not
Starlette's BaseHTTPMiddleware, which costs a task and a stream per request.

A request of a client that proved its key and was refused by the middleware (a body too large) can be reported
to the app with the first bytes of its body (``Refused``): the Tinker API answers a refused numbered request's
number, so the model's later requests are not held back by it. A request without an allowed key is only counted
and logged (rate-limited): what a client that proved nothing sends changes nothing any other client sees."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hmac
import os
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
import uvicorn
from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tinker_atropos.errors import FatalError
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.security import derive_key, insecure, read_keys, service_token
from tinker_atropos.state.connection import describe

# what a middleware that refused a request tells the app: the request, its body's first bytes (``PREFIX_BYTES``
# at most, all of it when shorter), why
Refused = Callable[[Scope, bytes, str], Awaitable[None]]
PREFIX_BYTES = 64 << 10
# how long a route waits for its Redis calls before answering 503: a sound Redis answers in milliseconds, and 5 s
# rides out a busy moment (a fork to save, another client's large pipeline) while a client still hears, well
# within its own timeout (the tinker SDK's is 60 s, and it retries a 503), that the state store is away
REDIS_WAIT_S = 5.0
T = TypeVar("T")


async def read_prefix(receive: Receive, limit: int = PREFIX_BYTES) -> bytes:
    """The first ``limit`` bytes of a request's body (fewer when it is shorter), read from ``receive``."""
    chunks, size, more = [], 0, True
    while more and size < limit:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
    return b"".join(chunks)[:limit]


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key a request presents: ``X-API-Key`` (the tinker SDK), ``Authorization: Bearer`` (OpenAI clients,
    atroposlib's servers) or the password of ``Authorization: Basic`` (a URL ``http://user:KEY@host``, all an
    atroposlib environment can send its trajectory API); empty without one."""
    found = dict(headers)
    if b"x-api-key" in found:
        return found[b"x-api-key"]
    scheme, _, value = found.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return value.strip()
    if scheme.lower() == b"basic":
        try:
            return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


class APIKeys:
    """401 for any request without an allowed key (``presented_key``), before routing (but on ``open_paths``,
    such as a health check), its body unread; each counted in ``refusals`` by reason and client host."""

    def __init__(
        self,
        app: ASGIApp,
        keys: list[bytes],
        open_paths: frozenset[str] = frozenset(),
        refusals: CountedWarnings | None = None,
    ) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths
        self.refusals = refusals if refusals is not None else CountedWarnings("HTTP requests refused (401)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = presented_key(scope["headers"])
        if given and any(hmac.compare_digest(given, key) for key in self.keys):
            return await self.app(scope, receive, send)
        reason = (
            "an API key is required (X-API-Key, or Authorization: Bearer)"
            if not given
            else "the API key is not allowed here"
        )
        host = (scope.get("client") or ("unknown",))[0]
        self.refusals.add(
            f"{'no key' if not given else 'a wrong key'} from {host}", f"{scope['method']} {scope['path']}"
        )
        await JSONResponse({"detail": reason}, status_code=401)(scope, receive, send)


class RedisCalls:
    """Where an HTTP front-end's routes make their Redis calls: in ``threads`` threads of its own, never on the
    event loop, so that a Redis that hangs holds those threads and not the loop (health checks, and routes that
    need no Redis, answer on). A route that waited ``wait_s`` for its call, or whose call lost Redis, gets a 503
    with a message and ``Retry-After``; the call itself goes on in its thread until Redis answers or the client
    gives up (``state.connection.connect``: ``SOCKET_TIMEOUT_S`` a try), and one still queued when its route gave
    up never runs.
    ``failed`` is called, in the calling thread, for every call that raised a Redis error, whether or not its
    route still waited: for state mirrored in memory, which must then be read back."""

    def __init__(
        self,
        name: str,
        threads: int,
        wait_s: float = REDIS_WAIT_S,
        retry_after_s: int = 1,
        failed: Callable[[], None] | None = None,
    ) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.wait_s, self.retry_after_s, self.failed = wait_s, retry_after_s, failed
        self.unavailable = CountedWarnings("HTTP requests answered 503 (Redis unavailable)")

    async def __call__(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``work(*args, **kwargs)``'s result, run in the pool; HTTPException 503 when Redis is away."""
        call = functools.partial(self._run, work, *args, **kwargs)
        try:
            return await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self.pool, call), self.wait_s
            )
        except TimeoutError:
            cause = f"no answer within {self.wait_s:g} s"
        except (redis.ConnectionError, redis.TimeoutError) as error:
            cause = describe(error)
        detail = f"the state store (Redis) is unavailable ({cause}): retry later"
        self.unavailable.add(cause.partition(":")[0], detail)
        raise HTTPException(503, detail, headers={"Retry-After": str(self.retry_after_s)})

    def _run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return work(*args, **kwargs)
        except redis.RedisError:
            if self.failed is not None:
                self.failed()
            raise


def endpoint_keys(purpose: str, keys_file: str | None, setting: str, what: str) -> list[str]:
    """The keys an HTTP endpoint of the run accepts: those of ``keys_file`` (the config field ``setting``), else
    the one derived from the run's token for ``purpose`` (``run_key``), else none under ``--insecure``. FatalError
    when there is neither file nor token nor ``--insecure``: the endpoint is never open by accident."""
    if keys_file is not None:
        return read_keys(Path(keys_file), setting)
    if service_token() is not None:
        return [run_key(purpose)]
    if insecure():
        return []
    raise FatalError(
        f"the {what} asks an API key and there is none: set {setting}, or give the run's token "
        "(TA_TOKEN_FILE or TA_TOKEN, as `up` does: the key is derived from it), or pass --insecure "
        "(TA_INSECURE=1) to serve it open on a machine nobody else uses"
    )


def endpoint_key(purpose: str, keys_file: str | None) -> str | None:
    """The key a client of the run's ``purpose`` endpoint presents: the first of ``keys_file``, else the one
    derived from the run's token; None without either (an ``--insecure`` run's endpoint asks none)."""
    if keys_file is not None:
        return read_keys(Path(keys_file), "keys file")[0]
    return run_key(purpose) if service_token() is not None else None


def run_key(purpose: str, token: str | None = None) -> str:
    """The API key of the run's ``purpose`` endpoint (``atropos-api``, ``inference``), derived from the run's
    token (this process's, by default): every service that holds the token computes it, none can compute the
    token from it."""
    token = token if token is not None else service_token()
    if token is None:
        raise FatalError(f"no run token (TA_TOKEN_FILE or TA_TOKEN) to derive the {purpose} key from")
    return derive_key(token, f"http/{purpose}").hex()


class BackgroundServer:
    """An HTTP front-end's uvicorn in a daemon thread of a service: HTTPS with the services' certificate when
    ``TA_TLS_CERT`` and ``TA_TLS_KEY`` are set; ``start`` returns once it is bound (FatalError if it cannot bind)."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, what: str, sock: socket.socket | None = None
    ) -> None:
        cert, key = os.environ.get("TA_TLS_CERT"), os.environ.get("TA_TLS_KEY")
        tls = {"ssl_certfile": cert, "ssl_keyfile": key} if cert and key else {}
        self.scheme, self.what = ("https" if tls else "http"), what
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                lifespan="off",
                access_log=False,
                timeout_graceful_shutdown=2,
                **tls,
            )
        )
        # ``sock``: a listening socket handed down by the launcher, which outlives this process (see ``up``)
        run = functools.partial(self.server.run, sockets=[sock]) if sock is not None else self.server.run
        self.thread = threading.Thread(target=run, name=what, daemon=True)
        # where it listens, once started: kept, since a status (a heartbeat thread) asks for it also while the
        # server is closing its sockets
        self.url = ""

    def start(self, stop: threading.Event) -> None:
        self.thread.start()
        while not self.server.started and self.thread.is_alive() and not stop.is_set():
            stop.wait(0.05)
        if not self.server.started:
            if stop.is_set():
                return
            config = self.server.config
            raise FatalError(f"the {self.what} could not bind {config.host}:{config.port}")
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"{self.scheme}://{host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)


def service_client(base_url: str, timeout_s: float = 30.0, key: str | None = None) -> httpx.Client:
    """A client of the run's own HTTP services, by the gRPC channels' rule (``security.open_channel``): with
    ``TA_TLS_CA`` their certificate is verified against it, and the name checked is ``TA_TLS_SERVER_NAME`` when set,
    since services advertise pod IPs that no certificate lists; ``key`` goes in ``X-API-Key``."""
    ca, name = os.environ.get("TA_TLS_CA"), os.environ.get("TA_TLS_SERVER_NAME")
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True

    def server_name(request: httpx.Request) -> None:
        request.extensions["sni_hostname"] = name

    hooks = {"request": [server_name]} if name and ca else {}
    headers = {"X-API-Key": key} if key else {}
    return httpx.Client(
        base_url=base_url, timeout=timeout_s, verify=verify, event_hooks=hooks, headers=headers
    )
