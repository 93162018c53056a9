"""The one owner of error translation: a GatewayError (or aiohttp's own 404, 405, 413) becomes the error body of
the API the request came in on, and anything unexpected a 500 that quotes the request id (the detail is logged)."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.apis.adapter import Adapter
from gateway.apis.routes import api_of
from gateway.errors import GatewayError, NotFound, PayloadTooLarge
from gateway.server.resources import EXCHANGE, REQUEST_ID

log = logging.getLogger(__name__)


def error_response(err: GatewayError, adapter: Adapter | None = None) -> web.Response:
    """The error in the envelope of the API the request came in on (OpenAI's for every other path)."""
    body = adapter.envelope(err) if adapter is not None else err.envelope()
    return web.json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def envelope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, or its error in its API's envelope."""
    try:
        return await handler(request)
    except GatewayError as exc:
        ex = request.get(EXCHANGE)
        if ex is not None:
            ex.error = exc
        return error_response(exc, _api(request))
    except web.HTTPException as exc:
        return error_response(_from_http(exc), _api(request))
    except ConnectionResetError:
        raise  # the client is gone: nothing to answer, nothing to log
    except Exception:
        # Full detail goes to the log only; the client gets the request id to quote.
        request_id = request[REQUEST_ID]
        log.exception("unhandled error in request %s", request_id)
        if request.writer.output_size > 0:
            raise  # a started response cannot become an error envelope: aiohttp drops the connection
        return error_response(GatewayError(f"Internal error; quote request id {request_id}"), _api(request))


def _api(request: web.Request) -> Adapter | None:
    """The API of a request to one of its paths, whatever the method (a GET /v1/messages is refused in
    Anthropic's envelope too); None for the gateway's own paths."""
    return api_of(request.path)


def _from_http(exc: web.HTTPException) -> GatewayError:
    if exc.status == 404:
        return NotFound("Unknown path; see /v1/models and the README for the endpoints", code="unknown_path")
    if exc.status == 413:
        return PayloadTooLarge("The request body is over the size limit")
    err = GatewayError(exc.reason)
    err.status = exc.status
    err.error_type = "invalid_request_error" if exc.status < 500 else "server_error"
    return err
