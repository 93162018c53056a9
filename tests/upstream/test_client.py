"""The gateway's HTTP client against real servers: keep-alive, streaming, timeouts and broken peers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.upstream.client import ConnectError, Disconnected, Pool, ResponseTimeout, _request_head, _target
from tests.fixtures.conditions import until
from tests.fixtures.processes import free_port
from tests.fixtures.timers import armed_timers

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    """A TCP server that speaks whatever bytes the test writes: for faults a real HTTP server never makes."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def replying(data: bytes, *, then_close: bool) -> Handler:
    """A raw handler that reads one request, writes `data`, then closes or keeps the connection a while."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(data)
        await writer.drain()
        if then_close:
            writer.close()
        else:
            await asyncio.sleep(1)

    return handle


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    client = Pool()
    yield client
    await client.close()


@pytest.fixture
async def echo_server() -> AsyncIterator[tuple[str, list[str], list[Mapping[str, str]]]]:
    """An aiohttp server that answers with the body it got and records each request's peer and headers."""
    peers: list[str] = []
    seen: list[Mapping[str, str]] = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(str(request.transport.get_extra_info("peername")) if request.transport else "")
        seen.append(request.headers)  # case-insensitive
        return web.Response(body=await request.read(), content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(str(request.transport.get_extra_info("peername")) if request.transport else "")
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(int(request.query.get("n", "3"))):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(float(request.query.get("gap", "0")))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/stream", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", peers, seen
    await server.close()


async def test_sequential_requests_reuse_one_keep_alive_connection(pool: Pool, echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server
    for i in range(20):
        response = await pool.request("POST", f"{base}/echo", f'{{"i": {i}}}'.encode(), {"content-type": "x"})
        assert response.status == 200
        assert await response.read() == f'{{"i": {i}}}'.encode()
    assert len(set(peers)) == 1


async def test_requests_on_a_kept_alive_connection_arm_one_read_timer_not_one_per_wait(
    pool: Pool, echo_server, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """With uvloop a timer armed and cancelled costs ~7,600 instructions: the read deadline is re-armed only
    when it fires early (gateway/upstream/deadline.py), not at each wait for bytes."""
    base, _, _ = echo_server
    armed = armed_timers(asyncio.get_running_loop(), monkeypatch)
    for i in range(25):
        if i == 5:  # the connection's own (its connect, its read deadline, the pool's idle sweep) are armed
            before = len(armed)
        response = await pool.request("POST", f"{base}/echo", b"{}", read_s=30, total_s=60)
        assert await response.read() == b"{}"
    assert len(armed) == before


async def test_a_shorter_read_timeout_after_longer_ones_on_the_same_connection_still_holds(
    pool: Pool, echo_server  # type: ignore[no-untyped-def]
) -> None:
    base, peers, _ = echo_server
    for _ in range(3):
        response = await pool.request("POST", f"{base}/echo", b"{}", read_s=60)
        await response.read()
    response = await pool.request("GET", f"{base}/stream?n=2&gap=30", read_s=0.3)
    async with asyncio.timeout(10):  # not the earlier requests' 60 s
        with pytest.raises(ResponseTimeout):
            async for _ in response.iter_chunks():
                pass
    assert len(peers) == 4 and len(set(peers)) == 1  # the stream went on the connection the others used


@pytest.mark.parametrize("breaking", ["\r", "\n", "\r\n", "\n\r", "\r\nx-injected: 1"])
@pytest.mark.parametrize("where", ["name", "value"])
def test_a_header_with_any_line_break_is_left_out_and_the_others_are_written(breaking: str, where: str) -> None:
    bad = {"name": (f"x-b{breaking}ad", "1"), "value": ("x-bad", f"a{breaking}b")}[where]
    headers = {"x-first": "1", bad[0]: bad[1], "x-last": "2"}
    head = _request_head("POST", _target("http://h:1/v1/x"), b"{}", headers).decode()
    assert head == "POST /v1/x HTTP/1.1\r\nhost: h:1\r\ncontent-length: 2\r\nx-first: 1\r\nx-last: 2\r\n\r\n"
    clean = _request_head("GET", _target("http://h:1/"), b"", {"x-a": "é"})
    assert clean == "GET / HTTP/1.1\r\nhost: h:1\r\nx-a: é\r\n\r\n".encode()


async def test_headers_are_sent_and_a_header_with_a_line_break_cannot_inject_another(pool: Pool, echo_server) -> None:  # type: ignore[no-untyped-def]
    base, _, seen = echo_server
    headers = {"x-request-id": "abc", "x-evil": "a\r\nx-injected: 1"}
    response = await pool.request("POST", f"{base}/echo", b"{}", headers)
    await response.read()
    assert seen[0]["x-request-id"] == "abc"
    assert "x-injected" not in seen[0]
    assert seen[0]["Content-Length"] == "2"


async def test_a_stream_is_delivered_chunk_by_chunk_as_it_is_written(pool: Pool, echo_server) -> None:  # type: ignore[no-untyped-def]
    base, _, _ = echo_server
    response = await pool.request("GET", f"{base}/stream?n=3&gap=0.3", read_s=5)
    assert response.headers["content-type"] == "text/event-stream"
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[float, bytes]] = []
    async for chunk in response.iter_chunks():
        arrivals.append((loop.time(), chunk))
    response.release()
    assert b"".join(c for _, c in arrivals) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # Relayed as written, not buffered to the end: the first event came well before the last.
    assert arrivals[-1][0] - arrivals[0][0] > 0.4


async def test_next_chunk_hands_over_what_arrived_then_none_at_the_end(pool: Pool, echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server
    response = await pool.request("GET", f"{base}/stream?n=3&gap=0.05", read_s=5)
    chunks = []
    while (chunk := await response.next_chunk()) is not None:
        chunks.append(chunk)
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(chunks) >= 2  # as they came
    assert await response.next_chunk() is None  # the end stays the end
    response.release()
    again = await pool.request("POST", f"{base}/echo", b"{}")
    assert await again.read() == b"{}"
    assert len(set(peers)) == 1  # the finished connection went back to the pool


async def test_a_stalled_stream_times_out_after_read_s(pool: Pool, echo_server) -> None:  # type: ignore[no-untyped-def]
    base, _, _ = echo_server
    response = await pool.request("GET", f"{base}/stream?n=2&gap=3", read_s=0.3)
    chunks = []
    with pytest.raises(ResponseTimeout):
        async for chunk in response.iter_chunks():
            chunks.append(chunk)
    assert chunks == [b"data: 0\n\n"]


async def test_headers_that_never_come_time_out(pool: Pool) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with raw_server(silent) as base:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ResponseTimeout):
            await pool.request("POST", f"{base}/x", b"{}", read_s=10, total_s=0.3)
        assert asyncio.get_running_loop().time() - started < 2


async def test_a_closed_port_is_a_connect_error(pool: Pool) -> None:
    with pytest.raises(ConnectError):
        await pool.request("POST", f"http://127.0.0.1:{free_port()}/x", b"{}", connect_s=1)


async def test_bytes_that_are_not_http_are_a_disconnect(pool: Pool) -> None:
    async with raw_server(replying(b"SSH-2.0-OpenSSH\r\n\r\n", then_close=False)) as base:
        with pytest.raises(Disconnected):
            await pool.request("POST", f"{base}/x", b"{}", read_s=2)


async def test_a_connection_closed_mid_body_is_a_disconnect(pool: Pool) -> None:
    truncated = replying(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part", then_close=True)
    async with raw_server(truncated) as base:
        response = await pool.request("POST", f"{base}/x", b"{}", read_s=2)
        with pytest.raises(Disconnected):
            await response.read()


async def test_a_body_delimited_by_close_is_read_whole(pool: Pool) -> None:
    close_delimited = replying(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it", then_close=True)
    async with raw_server(close_delimited) as base:
        response = await pool.request("POST", f"{base}/x", b"{}", read_s=2)
        assert await response.read() == b"all of it"


async def test_an_interim_100_response_is_skipped(pool: Pool) -> None:
    async with raw_server(replying(b"HTTP/1.1 100 Continue\r\n\r\n" + OK, then_close=False)) as base:
        response = await pool.request("POST", f"{base}/x", b"{}", read_s=2)
        assert (response.status, await response.read()) == (200, b"{}")


async def test_a_kept_alive_connection_the_server_dropped_is_retried_once_on_a_fresh_one(pool: Pool) -> None:
    connections = 0

    async def drops_second_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await read_request(reader)  # the reuse: close without answering, as a keep-alive timeout would
        writer.transport.abort()

    async with raw_server(drops_second_request) as base:
        first = await pool.request("POST", f"{base}/x", b"{}", read_s=2)
        assert await first.read() == b"{}"
        second = await pool.request("POST", f"{base}/x", b"{}", read_s=2)
        assert await second.read() == b"{}"
    assert connections == 2


async def test_a_fresh_connection_that_drops_is_not_retried(pool: Pool) -> None:
    attempts = 0

    async def drops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        await read_request(reader)
        writer.transport.abort()

    async with raw_server(drops) as base:
        with pytest.raises(Disconnected):
            await pool.request("POST", f"{base}/x", b"{}", read_s=2)
    assert attempts == 1


async def test_at_the_limit_requests_wait_for_a_connection_instead_of_opening_more(echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server
    pool = Pool(limit=1)
    try:
        async def one(i: int) -> bytes:
            response = await pool.request("POST", f"{base}/echo", str(i).encode())
            return await response.read()

        assert await asyncio.gather(*(one(i) for i in range(5))) == [str(i).encode() for i in range(5)]
    finally:
        await pool.close()
    assert len(set(peers)) == 1


async def test_a_wave_leaves_at_most_max_idle_connections_open_the_newest_kept(echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server
    pool = Pool(max_idle=3)
    try:
        wave = await asyncio.gather(*(pool.request("POST", f"{base}/echo", b"{}") for _ in range(10)))
        connections = [response._connection for response in wave]
        for response in wave:  # put back in this order: the last three are the newest idle ones
            await response.read()
        await until(lambda: sum(c.closed for c in connections) == 7, what="all but three idle connections closed")
        assert [c.closed for c in connections] == [True] * 7 + [False] * 3
        assert len(pool._open[connections[0].origin]) == 3
        # The next requests reuse the three kept, newest first, and open no other.
        again = [await (await pool.request("POST", f"{base}/echo", b"1")).read() for _ in range(3)]
        assert again == [b"1"] * 3 and len(set(peers)) == 10
    finally:
        await pool.close()


async def test_connections_idle_past_idle_s_are_closed_not_kept_until_the_deployment_closes_them(echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server  # aiohttp's server keeps an idle connection 75 s
    pool = Pool(idle_s=0.3)
    try:
        wave = await asyncio.gather(*(pool.request("POST", f"{base}/echo", b"{}") for _ in range(8)))
        connections = [response._connection for response in wave]
        for response in wave:
            await response.read()
        assert not any(c.closed for c in connections)  # idle in the pool, for reuse within idle_s
        await until(lambda: all(c.closed for c in connections), what="the idle connections closed")
        assert not any(pool._open.values()) and not any(pool._idle.values())
        # The pool still serves, on a new connection.
        assert await (await pool.request("POST", f"{base}/echo", b"1")).read() == b"1"
        assert len(set(peers)) == 9
    finally:
        await pool.close()


async def test_a_cancelled_request_closes_its_connection(pool: Pool) -> None:
    arrived, closed = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()  # returns at EOF: the client dropped the connection
        closed.set()

    async with raw_server(slow) as base:
        task = asyncio.ensure_future(pool.request("POST", f"{base}/x", b"{}", read_s=30))
        await asyncio.wait_for(arrived.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 2)


async def test_at_the_limit_a_request_waits_for_a_connection_no_longer_than_connect_s() -> None:
    arrived = asyncio.Event()

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()  # until the client drops the connection

    pool = Pool(limit=1)
    async with raw_server(never_answers) as base:
        busy = asyncio.ensure_future(pool.request("POST", f"{base}/x", b"{}", read_s=30))
        try:
            await asyncio.wait_for(arrived.wait(), 5)
            async with asyncio.timeout(5):  # without a deadline at the limit, this waited for good
                with pytest.raises(ResponseTimeout, match="came free"):
                    await pool.request("POST", f"{base}/x", b"{}", connect_s=0.2, read_s=30)
                with pytest.raises(ResponseTimeout, match="came free"):
                    await pool.request("POST", f"{base}/x", b"{}", read_s=30, total_s=0.2)
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            await pool.close()


async def test_a_waiter_cancelled_just_after_it_was_handed_a_connection_passes_it_on(echo_server) -> None:  # type: ignore[no-untyped-def]
    base, peers, _ = echo_server
    pool = Pool(limit=1)
    try:
        first = await pool.request("POST", f"{base}/echo", b"1")
        waiting = asyncio.ensure_future(pool.request("POST", f"{base}/echo", b"2"))
        async with asyncio.timeout(5):
            while not any(pool._waiters.values()):  # the second request is queued at the limit
                await asyncio.sleep(0)
        assert await first.read() == b"1"  # releases the connection: handed to the waiter
        waiting.cancel()  # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        async with asyncio.timeout(5):  # a lost connection would keep the pool at its limit for good
            third = await pool.request("POST", f"{base}/echo", b"3", connect_s=1)
            assert await third.read() == b"3"
    finally:
        await pool.close()
    assert len(set(peers)) == 1  # the handed connection itself was reused


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_released_response_and_a_closed_connection_are_freed_at_once_not_by_the_cyclic_collector(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A response that held its parser (which holds the response's callbacks), a connection its deadline and
    its transport: each was a reference cycle, left for the collector. A wave of 1,000 streams in flight at
    one of its passes then waited for a rare full pass, and the process grew with every wave (issue 32)."""
    async def test() -> None:
        async with raw_server(replying(OK, then_close=False)) as base:
            pool = Pool(idle_s=0.05)
            try:
                response = await pool.request("POST", f"{base}/", b"{}", read_s=5)
                assert await response.read() == b"{}"
                freed_response, freed_connection = weakref.ref(response), weakref.ref(response._connection)
                del response
                assert freed_response() is None
                await until(lambda: freed_connection() is None, what="the idle connection closed and freed")
            finally:
                await pool.close()

    gc.disable()  # only reference counting frees anything here
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(test())
    finally:
        gc.enable()
