"""What reading a request body costs (``frontends/bodies.py``), measured without a clock: the pre-scan counts what a
body's parse builds as ``bytes.count`` would, across its slices; and a gzip body is held once while the app reads
it (it was held twice, inflated and in Starlette's copy, through the whole parse)."""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tinker_atropos.frontends.bodies import SCAN_BYTES, BodyLimit, GzipRequests, scan


def test_the_scan_counts_as_bytes_count_across_slices() -> None:
    head = b'{"a":[[1,2],{}],"b":"[,{}"}'
    body = (
        head + b" " * (SCAN_BYTES - len(head) - 1) + b"{}" + b'[1,{"c":"d"},{}]' * 3
    )  # a "{}" across two slices
    assert body.index(b"{}", len(head)) == SCAN_BYTES - 1
    found = scan(body)
    assert (found.arrays, found.objects, found.empty_objects, found.commas, found.quotes, found.colons) == (
        body.count(b"["),
        body.count(b"{"),
        body.count(b"{}"),
        body.count(b","),
        body.count(b'"'),
        body.count(b":"),
    )


def test_a_gzip_body_is_held_once_while_the_app_reads_it() -> None:
    size = 8 << 20
    traced: list[int] = []

    async def route(request: Request) -> PlainTextResponse:
        body = await request.body()
        await asyncio.sleep(0)  # as a parse in a worker thread: the loop's step that read the body has ended
        traced.append(tracemalloc.get_traced_memory()[0])  # while the app holds the body, as a parse does
        return PlainTextResponse(str(len(body)))

    inner = GzipRequests(Starlette(routes=[Route("/", route, methods=["POST"])]), size, "limit")
    app = BodyLimit(inner, size, "limit")

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.post(
                "/", content=gzip.compress(b" " * size), headers={"Content-Encoding": "gzip"}
            )

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        answer = asyncio.run(post())
    finally:
        tracemalloc.stop()
    assert answer.text == str(size)
    assert traced[0] - before < 1.5 * size, (traced[0] - before) / size
