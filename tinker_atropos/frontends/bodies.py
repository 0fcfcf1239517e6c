"""What reading an HTTP request's body may cost, for every front-end (the Tinker API, the Atropos trajectory API,
the inference endpoint): bounded in bytes before routing (``BodyLimit``, a gzip body once inflated:
``GzipRequests``), and in what parsing it builds (``separators``, ``JSONBodies``: a pre-scan, a cap on values, error
lists cut short), parsed off the event loop once large (``OffLoop``), its memory handed back after."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic_core
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinker_atropos.frontends.http import PREFIX_BYTES, Refused, read_prefix

T = TypeVar("T")


def _replay(held: list[bytes], receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body ``held`` holds as one message, then what follows it (a
    disconnect). The body is taken out of ``held``, so that once the app has read it (Starlette's ``body()`` keeps a
    copy) nothing else holds it: a large body is held once while it is parsed, not twice."""

    async def replayed() -> Message:
        if not held:
            return await receive()
        return {"type": "http.request", "body": held.pop(), "more_body": False}

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
        held = [b"".join(chunks)]
        del chunks  # else the body is held twice while the app runs
        await self.app(scope, _replay(held, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, prefix: bytes) -> None:
        detail = f"request bodies are limited to {self.limit} bytes ({self.setting})"
        if self.refused is not None:
            await self.refused(scope, prefix, f"refused (413): {detail}")
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def _inflate(data: bytes, limit: int) -> list[bytes | None]:
    """``data`` gunzipped, ``limit`` + 1 bytes at most (more: over the limit), alone in a list (``GzipRequests``
    empties it); None when it is not gzip."""
    try:
        return [zlib.decompressobj(wbits=zlib.MAX_WBITS | 16).decompress(data, limit + 1)]
    except zlib.error:
        return [None]


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
        # handed over in a list emptied here: the executor's future holds the list, and its worker thread holds the
        # future a moment after the result is set (until it loops for the next task): a body of its own would be
        # held twice meanwhile
        handed = await asyncio.to_thread(_inflate, b"".join(chunks), self.limit)
        body = handed.pop()
        del chunks
        if body is None:
            return await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
        if len(body) > self.limit:
            detail = f"request bodies are limited to {self.limit} bytes once inflated ({self.setting})"
            return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
        kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*kept, (b"content-length", str(len(body)).encode())]}
        held = [body]
        del body
        await self.app(scope, _replay(held, receive), send)


class BodyError(Exception):
    """A request body refused by ``JSONBodies`` (``status``, ``detail``), answered by ``body_error``."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def body_error(request: Request, error: BodyError) -> JSONResponse:
    return JSONResponse({"detail": error.detail}, status_code=error.status)


INLINE_BYTES = 64 << 10  # a body this small is parsed on the event loop: a few milliseconds at most
MAX_ERRORS = 5  # validation errors reported per refused body; the rest only counted


SCAN_BYTES = 1 << 20  # a body is scanned this many bytes at a time (a comparison's scratch array each)
_ARRAY, _OBJECT, _END_OBJECT, _COMMA, _QUOTE, _COLON = b'[{},":'


@dataclass(frozen=True)
class Separators:
    """What parsing a JSON body builds grows with (those inside strings counted too), not with its bytes."""

    arrays: int
    objects: int
    empty_objects: int  # "{}"
    commas: int
    quotes: int  # escaped ones too: twice the strings at most
    colons: int  # an object's keys, and those in strings

    @property
    def containers(self) -> int:
        return self.arrays + self.objects


def scan(body: bytes) -> Separators:
    """A JSON body's ``Separators``, counted without parsing it: one pass of numpy's comparisons per slice, which
    let go of the GIL (four ``bytes.count`` held it for 0.4 s per 64 MiB)."""
    data = np.frombuffer(body, np.uint8)
    arrays = objects = empty_objects = commas = quotes = colons = 0
    for start in range(0, len(data), SCAN_BYTES):
        part = data[start : start + SCAN_BYTES + 1]  # one byte more: a "{}" across two slices
        head = part[:SCAN_BYTES]
        opens = part == _OBJECT
        arrays += np.count_nonzero(head == _ARRAY)
        objects += np.count_nonzero(opens[:SCAN_BYTES])
        empty_objects += np.count_nonzero(opens[:-1] & (part[1:] == _END_OBJECT))
        commas += np.count_nonzero(head == _COMMA)
        quotes += np.count_nonzero(head == _QUOTE)
        colons += np.count_nonzero(head == _COLON)
    return Separators(*(int(n) for n in (arrays, objects, empty_objects, commas, quotes, colons)))


def separators(body: bytes) -> tuple[int, int]:
    """(containers, commas) of a JSON body (``scan``)."""
    found = scan(body)
    return found.containers, found.commas


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


# a body (and its pre-scan's counts) read as JSON; ValueError if it is not JSON
Decode = Callable[[bytes, Separators], Any]


def _from_json(body: bytes, found: Separators) -> Any:
    return pydantic_core.from_json(body)


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

    async def parse(
        self,
        request: Request,
        adapter: TypeAdapter[T],
        check: Callable[[Any], None] | None = None,
        then: Callable[[T], Any] | None = None,
        decode: Decode | None = None,
    ) -> Any:
        """The body of ``request`` validated by ``adapter`` (what ``then`` makes of it, if given); BodyError for
        one refused. ``decode``: what reads the body once the pre-scan passed it (``from_json`` unless given)."""
        body = await request.body()
        return await self.off_loop.run(body, self._parse, body, adapter, check, then, decode or _from_json)

    def _parse(
        self,
        body: bytes,
        adapter: TypeAdapter[T],
        check: Callable[[Any], None] | None,
        then: Callable[[T], Any] | None,
        decode: Decode,
    ) -> Any:
        found = scan(body)
        commas = found.commas
        if self.max_values is not None and commas >= self.max_values:
            raise BodyError(
                413,
                f"the body holds {commas + 1} JSON values or more; no request here takes more "
                f"than {self.max_values}",
            )
        least = (
            CONTAINER_BYTES * (found.arrays + found.empty_objects)
            + OBJECT_BYTES * (found.objects - found.empty_objects)
            + SLOT_BYTES * commas
        )
        if len(body) > INLINE_BYTES and least > self.expansion * len(body):
            raise BodyError(
                413,
                f"the body's {found.containers} JSON arrays and objects would take at least "
                f"{least >> 20} MiB parsed, over {self.expansion} times its "
                f"{len(body) >> 20} MiB ({self.setting} bounds its bytes): send flatter data",
            )
        try:
            parsed = decode(body, found)
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
    shown = [
        {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
        for e in error.errors(include_url=False, include_input=False)[:MAX_ERRORS]
    ]
    if error.error_count() > MAX_ERRORS:
        more = error.error_count() - MAX_ERRORS
        shown.append({"type": "too_many_errors", "loc": ["body"], "msg": f"and {more} more errors"})
    return shown
