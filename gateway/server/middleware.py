"""The one middleware: request id, span and metrics per exchange, admin token, errors as the OpenAI envelope."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.accounting.keys import check_admin
from gateway.apis.adapter import Adapter
from gateway.apis.routes import BY_PATH
from gateway.errors import GatewayError, NotFound, PayloadTooLarge
from gateway.server.resources import ACCOUNTING, EXCHANGE, POLICY, REQUEST_ID, SETTINGS, TELEMETRY, TENANT
from gateway.telemetry.exchange import Exchange, span_name

log = logging.getLogger(__name__)

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Status of a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED = 499
CLIENT_ID_HEADER = "x-client-request-id"


def error_response(err: GatewayError, adapter: Adapter | None = None) -> web.Response:
    """The error in the envelope of the API the request came in on (OpenAI's for every other path)."""
    body = adapter.envelope(err) if adapter is not None else err.envelope()
    return web.json_response(body, status=err.status, headers=err.headers)


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


@web.middleware
async def exchange_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    telemetry = request.app[TELEMETRY]
    request_id = f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"
    request[REQUEST_ID] = request_id
    adapter = BY_PATH.get(request.path) if request.method == "POST" else None
    ex = None
    if adapter is not None:
        spans = telemetry.spans
        trace = spans.begin(span_name(adapter.endpoint), request.headers.get("traceparent")) if spans else None
        ex = Exchange(request_id, adapter.endpoint, adapter.operation, trace, _client_request_id(request))
        request[EXCHANGE] = ex
    status = 500
    try:
        response = await _respond(request, handler, ex, adapter)
        status = response.status
        if not response.prepared:  # a stream set its headers before its first byte (proxy._relay_stream)
            add_gateway_headers(request, response)
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away (its handler cancelled, or a write to it or a read of its body failed):
        # a client close, not a server error; there is no one to answer.
        status = CLIENT_CLOSED
        raise
    finally:
        if ex is not None:
            ex.finish(status, telemetry.metrics, telemetry.spans)


async def _respond(
    request: web.Request, handler: Handler, ex: Exchange | None, adapter: Adapter | None
) -> web.StreamResponse:
    """The handler's response, or its error as the OpenAI envelope."""
    app = request.app
    try:
        if request.path.startswith("/admin/"):
            auth = app[POLICY].current.auth
            check_admin(request.headers.get("authorization"), auth, app[SETTINGS].admin_token)
        elif request.path.startswith("/v1/") and app[POLICY].current.auth.enabled:
            # the caller's tenant from its API key (401 without a valid one); the key itself is never logged
            request[TENANT] = await app[ACCOUNTING].tenant(_credential(request))
        return await handler(request)
    except GatewayError as exc:
        if ex is not None:
            ex.error = exc
        return error_response(exc, adapter)
    except web.HTTPException as exc:
        return error_response(_from_http(exc), adapter)
    except ConnectionResetError:
        raise  # the client is gone: nothing to answer, nothing to log
    except Exception:
        # Full detail goes to the log only; the client gets the request id to quote.
        request_id = request[REQUEST_ID]
        log.exception("unhandled error in request %s", request_id)
        if request.writer.output_size > 0:
            raise  # a started response cannot become an error envelope: aiohttp drops the connection
        return error_response(GatewayError(f"Internal error; quote request id {request_id}"), adapter)


def _credential(request: web.Request) -> str | None:
    """The API key as a bearer credential: OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key`."""
    given = request.headers.get("authorization")
    if given is None and "x-api-key" in request.headers:
        given = "Bearer " + request.headers["x-api-key"]
    return given


def _from_http(exc: web.HTTPException) -> GatewayError:
    if exc.status == 404:
        return NotFound("Unknown path; see /v1/models and the README for the endpoints", code="unknown_path")
    if exc.status == 413:
        return PayloadTooLarge("The request body is over the size limit")
    err = GatewayError(exc.reason)
    err.status = exc.status
    err.error_type = "invalid_request_error" if exc.status < 500 else "server_error"
    return err


Response = TypeVar("Response", bound=web.StreamResponse)


def add_gateway_headers(request: web.Request, response: Response) -> Response:
    """Every response names its request id, and proxied ones the decision. Set by the middleware (and by a
    stream before it starts) rather than by an on_response_prepare signal, whose coroutine per response
    cost more than the headers."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id
    ex: Exchange | None = request.get(EXCHANGE)
    if ex is not None:
        response.headers["x-gateway-deployment"] = ex.deployment or "none"
        response.headers["x-gateway-rule"] = ex.rule or "none"
        if ex.client_request_id is not None:
            response.headers[CLIENT_ID_HEADER] = ex.client_request_id
    return response
