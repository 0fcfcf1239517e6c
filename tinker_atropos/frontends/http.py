"""What the HTTP front-ends share (Tinker API, Atropos trajectory API, inference endpoint): ASGI middleware for API
keys, a bound on request bodies and gzip-encoded request bodies, and the uvicorn thread they run in. Plain ASGI,
not Starlette's BaseHTTPMiddleware, which costs a task and a stream per request.

A request of a client that proved its key and was refused by the middleware (a body too large) can be reported
to the app with the first bytes of its body (``Refused``): the Tinker API answers a refused numbered request's
number, so the model's later requests are not held back by it. A request without an allowed key is only counted
and logged (rate-limited): what a client that proved nothing sends changes nothing any other client sees."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import ctypes.util
import functools
import hmac
import os
import socket
import ssl
import threading
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pydantic_core
import uvicorn
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinker_atropos.errors import FatalError
from tinker_atropos.logs import CountedWarnings
from tinker_atropos.security import derive_key, insecure, read_keys, service_token

# what a middleware that refused a request tells the app: the request, its body's first bytes (``PREFIX_BYTES``
# at most, all of it when shorter), why
Refused = Callable[[Scope, bytes, str], Awaitable[None]]
PREFIX_BYTES = 64 << 10
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

    def __init__(self, app: ASGIApp, keys: list[bytes], open_paths: frozenset[str] = frozenset(),
                 refusals: CountedWarnings | None = None) -> None:  # fmt: skip
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
    raise FatalError(f"the {what} asks an API key and there is none: set {setting}, or give the run's token "
                     "(TA_TOKEN_FILE or TA_TOKEN, as `up` does: the key is derived from it), or pass --insecure "
                     "(TA_INSECURE=1) to serve it open on a machine nobody else uses")  # fmt: skip


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


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` as one message, then what follows it (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class BodyLimit:
    """413 for a request body over ``limit`` bytes, unread (but for its first bytes) when its Content-Length
    says so, as soon as the bound is passed for a chunked one: a client cannot make the server hold an unbounded
    body. The body is read whole here and handed on as one message, so an over-size chunked body is a 413 naming
    ``setting`` (a route's own read would have failed into a 400 "error parsing the body")."""

    def __init__(self, app: ASGIApp, limit: int, setting: str, refused: Refused | None = None) -> None:
        self.app, self.limit, self.setting, self.refused = app, limit, setting, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"0")
        if declared.isdigit() and int(declared) > self.limit:
            prefix = await read_prefix(receive) if self.refused is not None else b""
            return await self._refuse(scope, receive, send, prefix)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, b"".join(chunks)[:PREFIX_BYTES])
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks  # else the body is held twice while the app runs
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, prefix: bytes) -> None:
        detail = f"request bodies are limited to {self.limit} bytes ({self.setting})"
        if self.refused is not None:
            await self.refused(scope, prefix, f"refused (413): {detail}")
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def _inflate(data: bytes, limit: int) -> bytes | None:
    """``data`` gunzipped, ``limit`` + 1 bytes at most (more: over the limit); None when it is not gzip."""
    try:
        return zlib.decompressobj(wbits=zlib.MAX_WBITS | 16).decompress(data, limit + 1)
    except zlib.error:
        return None


class GzipRequests:
    """Decompresses a ``Content-Encoding: gzip`` request body (as atroposlib's environments send large posts)
    before routing, in a worker thread (zlib lets go of the GIL: the event loop answers others meanwhile); 400 for
    a body that is not gzip, 413 when it inflates past ``limit`` bytes (a small bomb must not fill the memory)."""

    def __init__(self, app: ASGIApp, limit: int, setting: str) -> None:
        self.app, self.limit, self.setting = app, limit, setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", [])) if scope["type"] == "http" else {}
        if b"gzip" not in headers.get(b"content-encoding", b"").lower():
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = await asyncio.to_thread(_inflate, b"".join(chunks), self.limit)
        del chunks
        if body is None:
            return await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
        if len(body) > self.limit:
            detail = f"request bodies are limited to {self.limit} bytes once inflated ({self.setting})"
            return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
        kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*kept, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)


class BodyError(Exception):
    """A request body refused by ``JSONBodies`` (``status``, ``detail``), answered by ``body_error``."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def body_error(request: Request, error: BodyError) -> JSONResponse:
    return JSONResponse({"detail": error.detail}, status_code=error.status)


INLINE_BYTES = 64 << 10  # a body this small is parsed on the event loop: a few milliseconds at most
MAX_ERRORS = 5  # validation errors reported per refused body; the rest only counted


def separators(body: bytes) -> tuple[int, int]:
    """(containers, commas) of a JSON body, counted at memchr speed without parsing it (those inside strings
    too): what parsing it builds grows with them, not with its bytes."""
    return body.count(b"[") + body.count(b"{"), body.count(b",")


class OffLoop:
    """Work on a request body off the event loop once it is large: a body up to ``INLINE_BYTES`` is worked on
    here (milliseconds), a larger one in a worker thread, ``concurrency`` at a time, so that the event loop keeps
    answering everyone else (a health check, the long polls) and several large bodies at once cost a few
    parses' memory, not all of them; what such a parse freed is handed back to the system after it."""

    def __init__(self, concurrency: int) -> None:
        self._slots = asyncio.Semaphore(concurrency)

    async def run(self, body: bytes, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)``, which reads ``body``."""
        if len(body) <= INLINE_BYTES:
            return work(*args)
        async with self._slots:
            return await asyncio.to_thread(_trimmed, work, *args)


def _trimmed(work: Callable[..., T], *args: Any) -> T:
    try:
        return work(*args)
    finally:
        _return_freed_memory()  # in this thread: a trim takes a while


# the least each JSON value costs once parsed: an array or an empty object (an empty list is 56 bytes), an object
# with keys (184 bytes: a dict allocates its key table with its first key), and a value's slot in its parent
CONTAINER_BYTES, OBJECT_BYTES, SLOT_BYTES = 64, 192, 8


class JSONBodies:
    """Parses and validates JSON request bodies bounded by what parsing builds, not only by their bytes, for the
    routes of one app (the trajectory API, the inference endpoint):

    - before parsing, a scan at memchr speed refuses (413) a body whose containers and values alone would build
      more than ``expansion`` times its size in Python objects (``[[],[],…]``, deep nesting), and one of more
      than ``max_values`` values (commas) when the app has no use for more: a number costs 40 bytes parsed,
      eight times its JSON, whatever the schema then makes of it;
    - a body past ``INLINE_BYTES`` is parsed and validated in a worker thread, ``concurrency`` at a time, so the
      event loop keeps answering everyone else (a health check in milliseconds) and several big bodies at once
      cost one parse's memory, not several;
    - ``check``, on the parsed JSON, refuses what cannot line up (lengths that differ) before validation builds
      anything per item; validation stops at a list's first bad item (pydantic's fail-fast on the models' lists),
      and the 422 reports the first ``MAX_ERRORS`` errors and their count;
    - ``then`` runs in the same thread on the validated value (serialising it for storage, say)."""

    def __init__(
        self, setting: str, concurrency: int = 1, expansion: int = 8, max_values: int | None = None
    ) -> None:
        self.setting, self.expansion, self.max_values = setting, expansion, max_values
        self.off_loop = OffLoop(concurrency)

    async def parse(self, request: Request, adapter: TypeAdapter[T], check: Callable[[Any], None] | None = None,
                    then: Callable[[T], Any] | None = None) -> Any:  # fmt: skip
        """The body of ``request`` validated by ``adapter`` (what ``then`` makes of it, if given); BodyError for
        one refused."""
        body = await request.body()
        return await self.off_loop.run(body, self._parse, body, adapter, check, then)

    def _parse(self, body: bytes, adapter: TypeAdapter[T], check: Callable[[Any], None] | None,
               then: Callable[[T], Any] | None) -> Any:  # fmt: skip
        containers, commas = separators(body)
        if self.max_values is not None and commas >= self.max_values:
            raise BodyError(413, f"the body holds {commas + 1} JSON values or more; no request here takes more "
                                 f"than {self.max_values}")  # fmt: skip
        objects, empty_objects = body.count(b"{"), body.count(b"{}")
        least = (CONTAINER_BYTES * (containers - objects + empty_objects)
                 + OBJECT_BYTES * (objects - empty_objects) + SLOT_BYTES * commas)  # fmt: skip
        if len(body) > INLINE_BYTES and least > self.expansion * len(body):
            raise BodyError(413, f"the body's {containers} JSON arrays and objects would take at least "
                                 f"{least >> 20} MiB parsed, over {self.expansion} times its "
                                 f"{len(body) >> 20} MiB ({self.setting} bounds its bytes): send flatter data")  # fmt: skip
        try:
            parsed = pydantic_core.from_json(body)
        except ValueError as error:
            raise BodyError(400, f"the body is not JSON: {error}") from None
        problem: BodyError | None = None
        if check is not None:
            try:
                check(parsed)
            except ValueError as error:
                problem = BodyError(422, str(error))
        if problem is None:
            try:
                value = adapter.validate_python(parsed)
            except ValidationError as error:
                problem = BodyError(422, validation_errors(error))
        # dropped before raising: an exception raised where ``parsed`` is alive keeps it alive in its traceback
        # until the answer is sent, while the next body is parsed already
        del parsed
        if problem is not None:
            raise problem
        return then(value) if then is not None else value


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def _return_freed_memory() -> None:
    """glibc keeps what a big parse freed for later; handed back to the system, a refused body's memory returns."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def json_body(model: Any) -> Any:
    """A route parameter's ``Depends``: the request's body validated as ``model`` by its app's ``JSONBodies``
    (``app.state.bodies``), off the event loop when it is large."""
    adapter = TypeAdapter(model)

    async def parsed(request: Request) -> Any:
        return await request.app.state.bodies.parse(request, adapter)

    return Depends(parsed)


def validation_errors(error: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's 422 detail for ``error`` (without the values given: a NaN is no JSON), its first ``MAX_ERRORS``
    errors, then one saying how many more there were."""
    shown = [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
             for e in error.errors(include_url=False, include_input=False)[:MAX_ERRORS]]  # fmt: skip
    if error.error_count() > MAX_ERRORS:
        more = error.error_count() - MAX_ERRORS
        shown.append({"type": "too_many_errors", "loc": ["body"], "msg": f"and {more} more errors"})
    return shown


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
