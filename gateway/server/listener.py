"""The listening side: aiohttp's server, set up the one way that `serve` and the tests both run it.

aiohttp answers what never reaches the app (bytes that are not HTTP, a header over its size limit) from
its connection handler, in plain text, bypassing the middleware; and it gives a client that trickles a
request's head as long as the idle keep-alive timeout. The connection handler here answers those with
the OpenAI envelope too, and closes a connection whose head has not arrived within header_timeout_s.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_request import BaseRequest

from gateway.apis import json_body
from gateway.errors import BadRequest, GatewayError, HeaderTooLarge, RequestTimeout
from gateway.server.settings import Settings
from gateway.upstream.deadline import Deadline

log = logging.getLogger(__name__)

# aiohttp's idle keep-alive default under web.run_app, which the gateway ran under before this module.
KEEPALIVE_S = 75.0
SHUTDOWN_S = 60.0  # requests in flight at SIGTERM get this long to finish
LINGER_S = 2.0  # after a 408, the client's further bytes are read and dropped this long before the close
MAX_FIELD_BYTES = 8190  # aiohttp's limit on one header line; longer ones get 431


def runner_options(settings: Settings) -> dict[str, Any]:
    """The server's options, in one place: a client that goes away cancels its handler (and so the
    upstream request), no access log (the gateway's metrics and spans record every request)."""
    return {
        "handler_cancellation": True,
        "access_log": None,
        "keepalive_timeout": KEEPALIVE_S,
        "shutdown_timeout": SHUTDOWN_S,
        "max_field_size": MAX_FIELD_BYTES,
    }


class GatewayRunner(web.AppRunner):
    """aiohttp's AppRunner with the gateway's server options and connection handler."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__(app, **runner_options(settings))
        self._header_timeout_s = settings.header_timeout_s

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app; aiohttp's server with its options
        return GatewayServer.adopt(plain, self._header_timeout_s)


class GatewayServer(web.Server):
    """aiohttp's low-level server whose connections are handled by `Connection`."""

    header_timeout_s = 10.0

    @classmethod
    def adopt(cls, plain: web.Server, header_timeout_s: float) -> GatewayServer:
        server = cls(plain.request_handler, request_factory=plain.request_factory,
                     handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs)
        server.header_timeout_s = header_timeout_s
        return server

    def __call__(self) -> Connection:
        return Connection(self, self.header_timeout_s, loop=self._loop, **self._kwargs)


class Connection(web.RequestHandler):
    """One client connection: aiohttp's handler, plus a deadline on each request's head and every answer
    aiohttp gives by itself rendered as the OpenAI envelope.

    The head deadline runs from the connection's start and from the first byte of each later request
    (an idle keep-alive connection stays under aiohttp's keep-alive timeout). aiohttp state read here:
    `_messages` (parsed heads not yet handled) and `_waiter` (set while it waits for the next head).
    """

    def __init__(self, manager: web.Server, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_deadline = Deadline(self._loop, self._head_timed_out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._head_deadline.pending and self._between_requests():
            self._start_head_deadline()
        super().data_received(data)
        if self._messages:  # a whole head arrived (or a parse error that is answered now)
            self._head_deadline.clear()

    def _between_requests(self) -> bool:
        waiter = self._waiter
        return not self._messages and waiter is not None and not waiter.done()

    def _start_head_deadline(self) -> None:
        self._head_deadline.set_at(self._loop.time() + self._header_timeout_s)

    def _head_timed_out(self) -> None:
        if self.transport is None or self._messages or self._request_in_progress:
            return
        err = RequestTimeout(f"The request's headers did not arrive within {self._header_timeout_s:g} s")
        body = json_body.encode(err.envelope())
        head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        transport = self.transport
        transport.write(head + body)
        # Close gently: FIN after the answer, then read and drop what the client still sends for a moment.
        # Closing at once with its bytes unread would reset the connection, and the client may lose the 408.
        self.close()  # aiohttp's: no more requests here; incoming bytes are dropped from now on
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's own error answers (bad HTTP, a header too long, a crash outside the middleware)."""
        if request.writer.output_size > 0:  # as aiohttp does: a started response cannot become an error
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if isinstance(exc, ConnectionResetError):
            raise ConnectionError("The client went away")  # nobody to answer; aiohttp drops the connection
        err = _error_of(status, exc)
        if err.status >= 500:
            log.error("error outside the middleware", exc_info=exc)
        else:
            log.debug("refused a request that is not valid HTTP: %r", exc)
        response = web.Response(body=json_body.encode(err.envelope()), status=err.status,
                                content_type="application/json")
        response.force_close()
        return response


def _error_of(status: int, exc: BaseException | None) -> GatewayError:
    if isinstance(exc, LineTooLong):
        return HeaderTooLarge(f"A request header (or the request line) is longer than {MAX_FIELD_BYTES} bytes")
    if 400 <= status < 500:
        return BadRequest("The request is not valid HTTP/1.1", code="invalid_http_request")
    err = GatewayError("Internal error")
    err.status = status if status >= 500 else 500
    return err


async def serve(app: web.Application, settings: Settings) -> None:
    """Listen on settings.host:port until SIGTERM or SIGINT, then shut down gracefully."""
    runner = GatewayRunner(app, settings)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=settings.workers > 1 or None)
        await site.start()
        await _stop_signal()
    finally:
        await runner.cleanup()


async def _stop_signal() -> None:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    try:
        await stopped.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
