"""The Responses API's retrieve, input_items, delete and cancel, answered from the gateway's own store
(store/conversations.py), as OpenAI's API answers them; a stored response is visible to its tenant only."""

from __future__ import annotations

from aiohttp import web

from gateway.apis.responses import stored
from gateway.apis.responses.stored import StoredResponse
from gateway.decision.admission import ANONYMOUS
from gateway.errors import BadRequest, StoreUnavailable
from gateway.server.resources import STATE, TENANT
from gateway.store.contract import StoreError


def _tenant(request: web.Request) -> str:
    return request.get(TENANT) or ANONYMOUS


async def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    found = await request.app[STATE].conversations.find(_tenant(request), response_id)
    if found is None:  # another tenant's is as absent as one that never was
        raise stored.not_found(response_id)
    return found


async def retrieve(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`."""
    return web.json_response(stored.retrieve(await _stored(request)))


async def input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items`."""
    return web.json_response(stored.input_items_page(await _stored(request), request.query))


async def delete(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`."""
    response_id = request.match_info["response_id"]
    conversations = request.app[STATE].conversations
    try:
        gone = await conversations.store.delete(_tenant(request), response_id)
    except StoreError as exc:
        raise StoreUnavailable("The store of stored responses is unavailable; retry shortly") from exc
    if not gone:
        raise stored.not_found(response_id)
    return web.json_response(stored.deleted(response_id))


async def cancel(request: web.Request) -> web.Response:
    """`POST /v1/responses/{id}/cancel`: only a background response can be cancelled, and the gateway runs none
    (every response is answered while its request is open), as OpenAI's API answers for a finished one."""
    found = await _stored(request)
    raise BadRequest(f"Cannot cancel response '{found.response_id}': only background responses can be cancelled",
                     param="response_id")


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/responses/{response_id}", retrieve)
    router.add_delete("/v1/responses/{response_id}", delete)
    router.add_get("/v1/responses/{response_id}/input_items", input_items)
    router.add_post("/v1/responses/{response_id}/cancel", cancel)
