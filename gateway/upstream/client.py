"""A lean HTTP/1.1 client for the deployments: pooled keep-alive connections, responses parsed by httptools.

Why not aiohttp's client: per request it builds a ClientRequest, a payload object, header multidicts,
trace hooks and several timers. On the 2-core machine this gateway is measured on, that cost more CPU
than all of the routing decision. Deployments speak plain HTTP/1.1 (JSON bodies and SSE) to the gateway,
so this is the whole client it needs: one request per connection at a time, Content-Length or chunked
responses, a read timeout between chunks, an overall deadline, and back-pressure on slow consumers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

from gateway.upstream.deadline import Deadline

# Per response, reading the deployment's socket stops once this much of the body waits for its consumer
# and resumes when the consumer has taken it: a slow client then costs a bounded amount of memory here,
# and the deployment's own writes wait (TCP back-pressure) instead of the gateway buffering its answer.
HIGH_WATER_BYTES = 64 * 1024
# The most one socket read takes in, hence what a response can pass the mark by (uvloop's own read buffer
# is 256 KiB: after a pause the kernel has that much queued, and one read would take it all).
READ_BYTES = 64 * 1024
# What a buffered piece costs besides its bytes (the bytes object's header, its deque slot): a stream of
# tiny chunks is bounded by the memory it holds, not only by its payload.
PIECE_OVERHEAD_BYTES = 64
# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s; never hand out one that old.
DEFAULT_IDLE_S = 4.0
# Idle connections kept per origin once a wave has passed (httpx keeps 20): a wave of a thousand streams
# would otherwise leave a thousand sockets, transports and buffers behind until idle_s, and the next
# wave's new ones land beside them, so each wave leaves the process larger.
DEFAULT_MAX_IDLE = 64


def _glibc(function: str) -> Callable[..., int] | None:
    """A function of glibc's allocator, where the C library has it (malloc_trim, mallopt)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return cast(Callable[..., int], getattr(ctypes.CDLL(name), function))
    except (OSError, AttributeError):
        return None


_TRIM = _glibc("malloc_trim")  # returns free heap pages to the OS
_M_ARENA_MAX = -8  # glibc's mallopt parameter: how many heaps threads may allocate from


def one_heap() -> bool:
    """Have every thread allocate from glibc's main heap, unless MALLOC_ARENA_MAX says otherwise; whether it was set.

    glibc gives each thread that contends for the heap a heap of its own: the span exporter's thread encodes its
    batches in one, which keeps what they freed beyond the main heap's reach and release_heap's timing. The
    exporter holds the GIL while it encodes, so one heap costs no waiting. Call it before any thread starts.
    """
    mallopt = _glibc("mallopt")
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(mallopt(_M_ARENA_MAX, 1))


def release_heap() -> None:
    """Give freed heap memory back to the OS after a large body was dropped.

    Bodies arrive in socket-read-sized pieces, which glibc serves from its heap and keeps when they are
    freed: without this, a process that once read a 32 MiB body stays that much larger.
    """
    if _TRIM is not None:
        _TRIM(0)


class HeapTrim:
    """Gives the heap back to the OS once a wave of responses has mostly ended, or once traffic that carried
    many large bodies went idle.

    A thousand streams at once, or a few hundred slow readers, leave the process tens of megabytes larger
    after they end: glibc keeps what they freed for reuse. When at least WAVE_RESPONSES were open at once
    and no more than a quarter of that peak still is, release_heap runs (in a thread: giving back 60 MB
    takes long enough to stall the event loop), TRIM_DELAY_S later (the ended requests' own objects are freed
    after their response) and at most once per TRIM_EVERY_S. A wave's tail of over WAVE_RESPONSES / 4 gets one
    more trim once it ended too; steady traffic after a wave triggers none.

    Agents' 100-200 KB steps leave the heap larger too, even at a handful of requests at a time: once
    WAVE_BYTES of request bodies went out since the last trim, the first TRIM_DELAY_S in which no response opened
    and none is open trims it. One timer looks, and looks again while traffic goes on (never once a request):
    steady traffic triggers none.
    """

    WAVE_RESPONSES = 64
    WAVE_BYTES = 32 * 1024 * 1024
    TRIM_DELAY_S = 0.5
    TRIM_EVERY_S = 2.0

    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.trims = 0
        self.carried = 0  # request body bytes since the last trim
        self.opens = 0  # responses opened, ever: the idle timer's way to tell traffic went on
        self._due: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._last_at = -math.inf

    def opened(self, body_bytes: int = 0) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        self.carried += body_bytes
        self.opens += 1

    def ended(self, loop: asyncio.AbstractEventLoop) -> None:
        self.open -= 1
        if self._due is None and self.peak >= self.WAVE_RESPONSES and self.open <= self.peak // 4:
            at = max(loop.time() + self.TRIM_DELAY_S, self._last_at + self.TRIM_EVERY_S)
            self._due = loop.call_at(at, self._trim, loop)
        elif self.open == 0 and self.carried >= self.WAVE_BYTES and self._due is None and self._idle is None:
            self._look_idle(loop)

    def _look_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        at = max(loop.time() + self.TRIM_DELAY_S, self._last_at + self.TRIM_EVERY_S)
        self._idle = loop.call_at(at, self._trim_idle, loop, self.opens)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = None
        # The next wave is measured from what is open now; a tail still this large counts as one.
        tail = self.open > self.WAVE_RESPONSES // 4
        self.peak = max(self.open, self.WAVE_RESPONSES) if tail else self.open
        self._release(loop)

    def _trim_idle(self, loop: asyncio.AbstractEventLoop, opens: int) -> None:
        self._idle = None
        if self.opens == opens and self.open == 0:
            self._release(loop)
        elif self.open == 0 and self._due is None:  # traffic went on and paused: look again from now
            self._look_idle(loop)
        # else the next response to end, with none left open, looks again

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_at, self.carried = loop.time(), 0
        self.trims += 1
        loop.run_in_executor(None, release_heap)

    def cancel(self) -> None:
        for handle in (self._due, self._idle):
            if handle is not None:
                handle.cancel()
        self._due = self._idle = None


class ClientError(Exception):
    """Base of every failure this client raises besides timeouts."""


class ConnectError(ClientError):
    """The deployment could not be reached (refused, unresolvable, TLS failure)."""


class Disconnected(ClientError):
    """The connection closed, or the deployment sent bytes that are not HTTP, before the response ended."""


class ResponseTimeout(TimeoutError):
    """No byte arrived within the read timeout, or the request ran past its overall deadline."""


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int


class _Target(NamedTuple):
    origin: Origin
    path: str  # path and query, as sent on the request line
    host_header: str


@functools.lru_cache(maxsize=512)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectError(f"Not an http(s) URL: {url}")
    default_port = 443 if parts.scheme == "https" else 80
    port = parts.port or default_port
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.hostname if port == default_port else f"{parts.hostname}:{port}"
    return _Target(Origin(parts.scheme, parts.hostname, port), path, host_header)


def _request_head(method: str, target: _Target, body: bytes, headers: Mapping[str, str]) -> bytes:
    start = f"{method} {target.path} HTTP/1.1\r\nhost: {target.host_header}\r\n"
    if body or method not in ("GET", "HEAD"):
        start += f"content-length: {len(body)}\r\n"
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # Never let a header split the request: one CR and one LF a field, else the fields are written one by one
    # without those that carry a line break (checked over the whole text at once: two C scans, not four a field).
    if fields.count("\n") != len(headers) or fields.count("\r") != len(headers):
        fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items() if _one_line(name, value)])
    # aiohttp's server decodes header bytes as UTF-8 with surrogateescape: this sends the client's bytes back.
    return f"{start}{fields}\r\n".encode("utf-8", "surrogateescape")


def _one_line(name: str, value: str) -> bool:
    return not ("\r" in value or "\n" in value or "\r" in name or "\n" in name)


class Response:
    """One response as it arrives. Status and headers are set when `Pool.request` returns it."""

    def __init__(self, connection: _Connection, read_s: float | None, deadline: float) -> None:
        self._connection = connection
        self._loop = connection.loop
        self._read_s = read_s
        self._deadline = deadline
        # None once released: the parser holds this response's callbacks, so keeping it would make each
        # response a reference cycle, freed only by the cyclic collector (the first 1,000 streams in flight
        # at one of its passes would wait for a full one), and a pass every few thousand requests.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names; repeated headers joined with ", "
        self.keep_alive = False
        self.headers_done = False
        self.complete = False
        self.got_bytes = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        self._whole = False  # read() wants the body at once: no mark to pause at

    # -- the parser's callbacks (httptools calls these while fed) ---------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # it is the one calling
        self.status = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        if self.status >= 200:  # an interim 1xx response is followed by the real one
            self.headers_done = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body) + PIECE_OVERHEAD_BYTES
        if self._buffered > HIGH_WATER_BYTES and not self._whole:
            self._connection.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:  # the end of a 1xx response: wait for the real one
            self.headers.clear()
            return
        self.complete = True
        self._wake()

    # -- fed by the connection ------------------------------------------------------------------------

    def feed(self, data: bytes | memoryview) -> None:
        parser = self._parser
        if parser is None:  # released: its connection is reused or dropped, so nothing feeds it any more
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(Disconnected(f"The deployment sent an invalid HTTP response: {exc}"))
            self._connection.abort()

    def connection_lost(self) -> None:
        if self.complete:
            return
        if self.headers_done and "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", ""
        ):
            self.complete = True  # a body delimited by the connection's close
            self._wake()
            return
        self.fail(Disconnected("The deployment closed the connection before the response ended"))

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- what callers use -----------------------------------------------------------------------------

    @property
    def buffered_bytes(self) -> int:
        """What of the body arrived and waits for its consumer (with the pieces' overhead)."""
        return self._buffered

    async def wait_headers(self) -> None:
        while not self.headers_done:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        self._whole = True
        try:
            while not self.complete:
                await self._wait_body()
        except BaseException:
            self.close()
            raise
        body = b"".join(self._chunks)
        self._chunks.clear()
        self.release()
        return body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, at most about HIGH_WATER_BYTES + READ_BYTES at a time: reading pauses
        while the caller has not come back for more. The caller releases or closes the response when done."""
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self.complete:
                return
            await self._wait_body()

    async def next_chunk(self) -> bytes | None:
        """iter_chunks' next piece, None at the end, as a plain coroutine for a reader of the whole body: an async
        generator costs a hook call and a weak reference each (the event loop tracks every one, to close it at
        shutdown)."""
        while not self._chunks:
            if self.complete:
                return None
            await self._wait_body()
        return self._take()

    def _take(self) -> bytes:
        """All that arrived since the last turn in one piece: a chunked body's many small chunks from one socket
        read become one write to the client, not one each."""
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return chunk

    async def read_prefix(self, size: int, timeout_s: float) -> bytes:
        """Up to about `size` bytes of the body, waiting at most timeout_s; then the connection is dropped."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._buffered < size and not self.complete:
                    await self._wait_body()
        except (TimeoutError, ClientError):
            pass
        except BaseException:  # cancelled: drop the connection all the same
            self.close()
            raise
        prefix = b"".join(self._chunks)[:size]
        self.close()
        return prefix

    async def _wait_body(self) -> None:
        """Wait for more of the body: what was buffered has been taken, so the socket may be read again."""
        self._connection.resume_reading()
        await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._loop.create_future()
        at = self._deadline if self._read_s is None else min(self._deadline, self._loop.time() + self._read_s)
        deadline = self._connection.deadline
        deadline.set_at(at)
        try:
            await self._waiter
        finally:
            self._waiter = None
            deadline.clear()
        if self._error is not None:
            raise self._error

    def timed_out(self) -> None:
        self.fail(ResponseTimeout("The deployment did not answer in time"))
        self._connection.abort()

    def release(self) -> None:
        """Done with the response: a finished keep-alive connection is reused, any other is closed."""
        if self._released:
            return
        self._released = True
        self._parser = None
        if self.complete and self.keep_alive and self._error is None:
            self._connection.reuse()
        else:
            self._connection.abort()
        self._connection.pool.heap.ended(self._loop)

    def close(self) -> None:
        """Drop the connection now (the deployment sees the close and stops generating)."""
        self._chunks.clear()  # what was buffered is never read now
        self._buffered = 0
        if not self._released:
            self._released = True
            self._parser = None
            self._connection.abort()
            self._connection.pool.heap.ended(self._loop)


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive TCP connection to an origin, carrying one request at a time.

    Buffered (the transport reads into the pool's one read buffer, at most READ_BYTES at a time) so that
    what a response holds past its high-water mark is bounded by that, not by the transport's read size.
    """

    def __init__(self, pool: Pool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reading_paused = False
        # the current response's read deadline while it waits for bytes (one timer for many waits)
        self.deadline = Deadline(loop, self._timed_out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.pool.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is not usable any more
            self.abort()
            return
        # The parser copies what it keeps (headers, body pieces), so the one buffer is free again after this.
        self.response.feed(self.pool.read_buffer[:nbytes])

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadline.cancel()
        self.transport = None  # it holds this protocol: the pair would wait for the cyclic collector
        if self.response is not None:
            self.response.connection_lost()
        self.pool.forget(self)

    def send(self, response: Response, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.response = response
        self.transport.writelines((head, body) if body else (head,))

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def reuse(self) -> None:
        self.response = None
        self.resume_reading()
        self.pool.put_back(self)

    def _timed_out(self) -> None:
        if self.response is not None:
            self.response.timed_out()

    def abort(self) -> None:
        self.response = None
        self.deadline.cancel()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)


class Pool:
    """The process's one pool of connections to deployments, at most `limit` open per origin."""

    def __init__(self, limit: int = 1024, idle_s: float = DEFAULT_IDLE_S, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        self._limit = limit
        self._idle_s = idle_s
        self._max_idle = max_idle
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: dict[Origin, set[_Connection]] = {}
        self._waiters: dict[Origin, collections.deque[asyncio.Future[_Connection | None]]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        # Every connection reads into this one buffer: a transport calls get_buffer, reads, then
        # buffer_updated, all in one callback of the one event loop, so no two reads ever overlap.
        self.read_buffer = memoryview(bytearray(READ_BYTES))
        self.heap = HeapTrim()
        self._sweep: asyncio.TimerHandle | None = None

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        connect_s: float | None = None,
        read_s: float | None = None,
        total_s: float | None = None,
        sent: Callable[[], None] | None = None,
    ) -> Response:
        """Send a request and return once the response's status and headers are in; `sent` is called once its
        bytes are handed to a connection (a caller cancelled before that knows the server never saw it)."""
        loop = asyncio.get_running_loop()
        target = _target(url)
        head = _request_head(method, target, body, headers or {})
        now = loop.time()
        deadline = now + total_s if total_s else math.inf
        # Waiting for a free connection at the limit and opening one share the connect budget.
        connect_by = min(now + connect_s if connect_s else math.inf, deadline)
        for first_try in (True, False):
            connection, reused = await self._acquire(target.origin, loop, connect_by)
            response = Response(connection, read_s, deadline)
            self.heap.opened(len(body))
            connection.send(response, head, body)
            if sent is not None:
                sent()
            try:
                await response.wait_headers()
            except Disconnected:
                # A kept-alive connection the deployment closed just as we reused it: nothing was
                # processed, so try once more on a fresh one.
                response.close()
                if first_try and reused and not response.got_bytes:
                    continue
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise AssertionError("unreachable")

    async def _acquire(
        self, origin: Origin, loop: asyncio.AbstractEventLoop, connect_by: float
    ) -> tuple[_Connection, bool]:
        if self._closed:
            raise ConnectError("The client is closed")
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self._idle_s:
                return connection, True
            connection.abort()
        opened = self._open.setdefault(origin, set())
        if len(opened) >= self._limit:
            handed = await self._wait_for_slot(origin, loop, connect_by)
            if handed is not None and not handed.closed:
                return handed, True
        return await self._connect(origin, loop, connect_by), False

    async def _wait_for_slot(
        self, origin: Origin, loop: asyncio.AbstractEventLoop, connect_by: float
    ) -> _Connection | None:
        """At the limit: a released connection, or None when a slot freed up, within the connect budget."""
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.setdefault(origin, collections.deque()).append(waiter)
        try:
            async with asyncio.timeout_at(None if connect_by == math.inf else connect_by):
                return await waiter
        except BaseException as exc:
            self._give_up(origin, waiter)
            if isinstance(exc, TimeoutError):
                raise ResponseTimeout(f"No connection to {origin.host}:{origin.port} came free in time") from exc
            raise

    def _give_up(self, origin: Origin, waiter: asyncio.Future[_Connection | None]) -> None:
        """A waiter timed out or was cancelled. If it had been handed a connection (or a free slot) just
        before, pass that on to the next waiter: dropped here, it would count against the limit for good."""
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters[origin].remove(waiter)
            return
        if waiter.cancelled():
            return
        handed = waiter.result()
        if handed is not None:
            self.put_back(handed)
        else:
            self._hand_to_waiter(origin, None)

    async def _connect(self, origin: Origin, loop: asyncio.AbstractEventLoop, connect_by: float) -> _Connection:
        connection = _Connection(self, origin, loop)
        self._open.setdefault(origin, set()).add(connection)
        tls = self._ssl_context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout_at(None if connect_by == math.inf else connect_by):
                await loop.create_connection(lambda: connection, origin.host, origin.port, ssl=tls)
        except TimeoutError as exc:
            self.forget(connection)
            raise ResponseTimeout(f"Connecting to {origin.host}:{origin.port} timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            self.forget(connection)
            raise ConnectError(f"Cannot connect to {origin.host}:{origin.port}: {exc.strerror or exc}") from exc
        except BaseException:
            self.forget(connection)
            raise
        return connection

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def put_back(self, connection: _Connection) -> None:
        if self._hand_to_waiter(connection.origin, connection):
            return
        if self._closed:
            connection.abort()
            return
        connection.idle_since = connection.loop.time()
        idle = self._idle.setdefault(connection.origin, [])
        idle.append(connection)
        if len(idle) > self._max_idle:
            idle.pop(0).abort()  # the oldest: the newest are handed out first
        if self._sweep is None:
            self._sweep = connection.loop.call_later(self._idle_s, self._close_stale, connection.loop)

    def _close_stale(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for idle_s: _acquire never hands those out, and kept open, a wave's
        thousand of them would each hold a socket and a transport until the deployment closed it."""
        self._sweep = None
        now, oldest = loop.time(), math.inf
        for idle in self._idle.values():
            fresh = [c for c in idle if now - c.idle_since < self._idle_s]
            stale = [c for c in idle if now - c.idle_since >= self._idle_s]
            idle[:] = fresh  # oldest first, as put back
            for connection in stale:
                connection.abort()
            if fresh:
                oldest = min(oldest, fresh[0].idle_since)
        if oldest != math.inf:
            self._sweep = loop.call_at(oldest + self._idle_s, self._close_stale, loop)

    def forget(self, connection: _Connection) -> None:
        """A connection closed: drop it and let one waiter open a new one in its place."""
        opened = self._open.get(connection.origin)
        if opened is None or connection not in opened:
            return
        opened.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)
        self._hand_to_waiter(connection.origin, None)

    def _hand_to_waiter(self, origin: Origin, handed: _Connection | None) -> bool:
        """Give the first request still waiting at the limit a connection, or (None) a free slot."""
        waiters = self._waiters.get(origin)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(handed)
                return True
        return False

    async def close(self) -> None:
        self._closed = True
        self.heap.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
        for opened in list(self._open.values()):
            for connection in list(opened):
                connection.abort()
        await asyncio.sleep(0)  # let the transports run their connection_lost callbacks
