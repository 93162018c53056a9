"""One exchange per request: the request's id, and for an API call its span, its metrics and the headers that
name the decision (the outermost middleware, so it sees the status the client got)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.apis.routes import BY_PATH
from gateway.errors import CLIENT_CLOSED
from gateway.server.resources import EXCHANGE, REQUEST_ID, STATE
from gateway.telemetry.exchange import Exchange, span_name

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CLIENT_ID_HEADER = "x-client-request-id"

# Unique across processes and restarts without a syscall per request: random prefix, then a counter.
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def _client_request_id(request: web.Request) -> str | None:
    """The client's own id for its request (OpenAI's `x-client-request-id`, or an `x-request-id`), if sane.

    It is echoed and recorded, never used as a key: the gateway's own id names the request everywhere
    (explain memory, logs, spans, the deployment), so one client cannot collide with another's.
    """
    given = request.headers.get(CLIENT_ID_HEADER) or request.headers.get("x-request-id")
    return given if given is not None and _SAFE_REQUEST_ID.match(given) else None


def exchange_middleware(app: web.Application) -> Middleware:
    """The middleware of `app` (its resources are read at each request: they exist once it has started)."""

    @web.middleware
    async def exchange(request: web.Request, handler: Handler) -> web.StreamResponse:
        state = app[STATE]
        request_id = f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"
        request[REQUEST_ID] = request_id
        adapter = BY_PATH.get(request.path) if request.method == "POST" else None
        ex = None
        if adapter is not None:
            spans = state.spans
            trace = spans.begin(span_name(adapter.endpoint), request.headers) if spans else None
            ex = Exchange(request_id, adapter.endpoint, adapter.operation, trace, _client_request_id(request))
            request[EXCHANGE] = ex
        status = 500
        try:
            response = await handler(request)
            status = response.status
            if not response.prepared:  # a stream set its headers before its first byte (relay)
                _name(response, request_id, ex)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (its handler cancelled, or a write to it or a read of its body failed):
            # a client close, not a server error; there is no one to answer.
            status = CLIENT_CLOSED
            raise
        finally:
            if ex is not None:
                ex.finish(status, state.metrics, state.spans)

    return exchange


Response = TypeVar("Response", bound=web.StreamResponse)


def add_gateway_headers(request: web.Request, response: Response) -> Response:
    """Every response names its request id, and proxied ones the decision. Set by the middleware (and by a
    stream before it starts) rather than by an on_response_prepare signal, whose coroutine per response
    cost more than the headers."""
    return _name(response, request.get(REQUEST_ID), request.get(EXCHANGE))


def _name(response: Response, request_id: str | None, ex: Exchange | None) -> Response:
    if request_id is not None:
        response.headers["x-request-id"] = request_id
    if ex is not None:
        response.headers["x-gateway-deployment"] = ex.deployment or "none"
        response.headers["x-gateway-rule"] = ex.rule or "none"
        if ex.client_request_id is not None:
            response.headers[CLIENT_ID_HEADER] = ex.client_request_id
    return response
