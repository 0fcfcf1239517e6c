"""What the HTTP front-ends share (Tinker API, Atropos trajectory API, inference endpoint): ASGI middleware for API
keys, a bound on request bodies and gzip-encoded request bodies, and the uvicorn thread they run in. Plain ASGI, not Starlette's BaseHTTPMiddleware, which costs a task and a
stream per request."""

from __future__ import annotations

import functools
import hmac
import os
import socket
import ssl
import threading
import zlib

import httpx
import uvicorn
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinker_atropos.runtime import FatalError


class APIKeys:
    """401 for any request without an allowed ``X-API-Key``, before routing (but on ``open_paths``, such as a
    health check)."""

    def __init__(self, app: ASGIApp, keys: list[bytes], open_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"x-api-key"), b"")
        if any(hmac.compare_digest(given, key) for key in self.keys):
            return await self.app(scope, receive, send)
        reason = "an X-API-Key header is required" if not given else "the API key is not allowed here"
        await JSONResponse({"detail": reason}, status_code=401)(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """413 for a request body over ``limit`` bytes, unread when its Content-Length says so, as soon as the
    bound is passed for a chunked one: a client cannot make the server hold an unbounded body. ``setting``
    names the config field of the bound in the answer."""

    def __init__(self, app: ASGIApp, limit: int, setting: str) -> None:
        self.app, self.limit, self.setting = app, limit, setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, bounded, send)
        except _TooLarge:  # raised while a route read its body, before it answered
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request bodies are limited to {self.limit} bytes ({self.setting})"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


class GzipRequests:
    """Decompresses a ``Content-Encoding: gzip`` request body (as atroposlib's environments send large posts)
    before routing; 400 for a body that is not gzip, 413 when it inflates past ``limit`` bytes (a small bomb
    must not fill the memory)."""

    def __init__(self, app: ASGIApp, limit: int, setting: str) -> None:
        self.app, self.limit, self.setting = app, limit, setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", [])) if scope["type"] == "http" else {}
        if b"gzip" not in headers.get(b"content-encoding", b"").lower():
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
        try:
            body = inflate.decompress(b"".join(chunks), self.limit + 1)
        except zlib.error:
            return await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
        if len(body) > self.limit:
            detail = f"request bodies are limited to {self.limit} bytes once inflated ({self.setting})"
            return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
        kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*kept, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def inflated() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # what follows the body: a disconnect
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, inflated, send)


class BackgroundServer:
    """An HTTP front-end's uvicorn in a daemon thread of a service: HTTPS with the services' certificate when
    ``TA_TLS_CERT`` and ``TA_TLS_KEY`` are set; ``start`` returns once it is bound (FatalError if it cannot bind)."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, what: str, sock: socket.socket | None = None
    ) -> None:
        cert, key = os.environ.get("TA_TLS_CERT"), os.environ.get("TA_TLS_KEY")
        tls = {"ssl_certfile": cert, "ssl_keyfile": key} if cert and key else {}
        self.scheme, self.what = ("https" if tls else "http"), what
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                                    access_log=False, timeout_graceful_shutdown=2, **tls))  # fmt: skip
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


def service_client(base_url: str, timeout_s: float = 30.0) -> httpx.Client:
    """A client of the run's own HTTP services, by the gRPC channels' rule (``security.open_channel``): with
    ``TA_TLS_CA`` their certificate is verified against it, and the name checked is ``TA_TLS_SERVER_NAME`` when set,
    since services advertise pod IPs that no certificate lists."""
    ca, name = os.environ.get("TA_TLS_CA"), os.environ.get("TA_TLS_SERVER_NAME")
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True

    def server_name(request: httpx.Request) -> None:
        request.extensions["sni_hostname"] = name

    hooks = {"request": [server_name]} if name and ca else {}
    return httpx.Client(base_url=base_url, timeout=timeout_s, verify=verify, event_hooks=hooks)
