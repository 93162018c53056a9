"""The upstream client's flow control against real servers: a response nobody reads holds a bounded buffer
and the deployment's writes wait on it; read on, the body arrives whole and in order; a wave of responses
that ended gives the heap back to the OS."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.test_utils import TestServer

from gateway.upstream.client import HIGH_WATER_BYTES, HeapTrim, Pool, Response
from tests.fixtures.conditions import until
from tests.upstream.test_client import raw_server, read_request

PIECE_BYTES = 64 * 1024
TOTAL_BYTES = 32 * 1024 * 1024  # far more than the sockets' buffers on loopback take in
# What one response may hold for a consumer that does not keep up: the mark (64 KiB), then one read past it.
BOUND_BYTES = 160 * 1024


def piece(i: int) -> bytes:
    return i.to_bytes(4, "big") * (PIECE_BYTES // 4)  # numbered, so order and loss both show in the digest


@dataclass
class Firehose:
    url: str
    written_bytes: int = 0
    protocol: BaseProtocol | None = None

    @property
    def waiting(self) -> bool:
        """The deployment's write is waiting: its transport's buffer is full, its peer does not read."""
        return self.protocol is not None and self.protocol.writing_paused


@pytest.fixture
async def firehose() -> AsyncIterator[Firehose]:
    """An aiohttp deployment that streams TOTAL_BYTES as fast as its peer takes them."""
    state = Firehose("")

    async def stream(request: web.Request) -> web.StreamResponse:
        state.protocol = request.protocol
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(TOTAL_BYTES // PIECE_BYTES):
            await response.write(piece(i))
            state.written_bytes += PIECE_BYTES
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    state.url = f"http://127.0.0.1:{server.port}/stream"
    yield state
    await server.close()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    client = Pool()
    yield client
    await client.close()


def paused(response: Response) -> bool:
    return response._connection._reading_paused or response.complete


async def test_a_response_nobody_reads_holds_a_bounded_buffer_and_the_deployments_writes_wait(
    pool: Pool, firehose: Firehose
) -> None:
    response = await pool.request("GET", firehose.url, read_s=10)
    # Both ends stopped: this side reads no more, so the deployment's write waits, and goes on waiting.
    await until(lambda: response._connection._reading_paused and firehose.waiting, what="both ends paused")
    assert firehose.written_bytes < TOTAL_BYTES
    assert 0 < response.buffered_bytes <= BOUND_BYTES
    response.close()


async def test_a_slow_consumer_takes_bounded_chunks_and_gets_the_whole_body_in_order(
    pool: Pool, firehose: Firehose
) -> None:
    response = await pool.request("GET", firehose.url, read_s=10)
    expected = hashlib.sha256(b"".join(piece(i) for i in range(TOTAL_BYTES // PIECE_BYTES))).hexdigest()
    digest, received, most = hashlib.sha256(), 0, 0
    chunks = response.iter_chunks()
    for _ in range(20):  # slowly: each time, only once reading paused again (the buffer at its fullest)
        await until(lambda: paused(response), what="reading paused")
        most = max(most, response.buffered_bytes)
        chunk = await anext(chunks)
        digest.update(chunk)
        received += len(chunk)
    assert firehose.written_bytes < TOTAL_BYTES  # it was made to wait all along
    async for chunk in chunks:
        most = max(most, len(chunk))
        digest.update(chunk)
        received += len(chunk)
    response.release()
    assert most <= BOUND_BYTES
    assert received == TOTAL_BYTES
    assert digest.hexdigest() == expected


async def test_a_stream_of_tiny_chunks_is_bounded_by_the_memory_they_hold_not_only_their_bytes(pool: Pool) -> None:
    count = 200_000
    body = b"1\r\nx\r\n" * count + b"0\r\n\r\n"  # chunked encoding, one byte a chunk

    async def tiny(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    async with raw_server(tiny) as base:
        response = await pool.request("GET", f"{base}/x", read_s=5)
        await until(lambda: paused(response), what="reading paused")
        # 64 KiB of one-byte pieces would hold ~4 MiB of objects: it pauses long before that many arrive.
        assert len(response._chunks) < HIGH_WATER_BYTES // 4
        assert sum(len(c) for c in await _all(response)) == count


async def _all(response: Response) -> list[bytes]:
    parts = [chunk async for chunk in response.iter_chunks()]
    response.release()
    return parts


async def test_a_body_far_over_the_mark_is_read_whole(pool: Pool, firehose: Firehose) -> None:
    response = await pool.request("GET", firehose.url, read_s=10)
    assert len(await response.read()) == TOTAL_BYTES


async def test_a_wave_of_responses_that_ended_gives_the_heap_back_once(pool: Pool) -> None:
    async def small(request: web.Request) -> web.Response:
        return web.Response(body=b"{}", content_type="application/json")

    app = web.Application()
    app.router.add_get("/x", small)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}/x"
    try:
        wave = await asyncio.gather(*(pool.request("GET", url, read_s=5) for _ in range(HeapTrim.WAVE_RESPONSES)))
        assert pool.heap.open == HeapTrim.WAVE_RESPONSES
        for response in wave:
            await response.read()
        await until(lambda: pool.heap.trims == 1, what="one trim after the wave")
        for _ in range(HeapTrim.WAVE_RESPONSES * 2):  # steady traffic, one at a time: no wave, no trim
            await (await pool.request("GET", url, read_s=5)).read()
        assert pool.heap.open == 0
        assert pool.heap._due is None and pool.heap.trims == 1
    finally:
        await server.close()


async def test_large_bodies_give_the_heap_back_once_traffic_idles_not_while_it_flows(pool: Pool) -> None:
    async def small(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"{}", content_type="application/json")

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/x", small)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url, body = f"http://127.0.0.1:{server.port}/x", b"x" * (100 * 1024)
    heap = pool.heap
    heap.WAVE_BYTES, heap.TRIM_DELAY_S = 1 << 20, 60.0  # an idle minute would be needed: none comes
    loop = asyncio.get_running_loop()
    try:
        await (await pool.request("POST", url, body, read_s=5)).read()
        assert heap._idle is None  # under WAVE_BYTES: nothing to look for
        for _ in range(20):  # 2 MB, one at a time: idle between each, for a moment only
            await (await pool.request("POST", url, body, read_s=5)).read()
        looking = heap._idle
        assert looking is not None and heap.trims == 0
        await (await pool.request("POST", url, body, read_s=5)).read()
        assert heap._idle is looking  # one timer for the traffic, not one a request
        looking.cancel()
        heap._trim_idle(loop, heap.opens - 1)  # had it fired now: traffic went on since it was set
        assert heap.trims == 0 and heap._idle is not None  # it looks again, no trim
        heap.cancel()
        heap.TRIM_DELAY_S = 0.05
        await (await pool.request("POST", url, body, read_s=5)).read()
        await until(lambda: heap.trims == 1, what="one trim once idle")
        assert heap.carried == 0 and heap._idle is None
        await (await pool.request("POST", url, body, read_s=5)).read()  # under WAVE_BYTES again: no timer
        assert heap._idle is None
    finally:
        await server.close()


_THREADS_ALLOCATE = """
import ctypes, ctypes.util, sys, threading
from gateway.upstream.client import one_heap
if sys.argv[1] == "one":
    assert one_heap()
held = []
def allocate():
    held.append([bytes(2048) for _ in range(2000)])  # over pymalloc's 512 B: glibc's heap
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_stats()  # one "Arena N:" per heap, on stderr
"""


@pytest.mark.parametrize(("mode", "one"), [("one", True), ("default", False)])
def test_one_heap_has_threads_allocate_from_the_main_heap(mode: str, one: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", _THREADS_ALLOCATE, mode], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    heaps = done.stderr.count("Arena ")
    assert heaps == 1 if one else heaps > 1, done.stderr
