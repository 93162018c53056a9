"""The originals of masked tool outputs, by the reference their stubs name:

    GET /v1/context/{ref}                 the caller's own (its API key's tenant)
    GET /admin/context/{ref}?tenant=T     any tenant's, for operators (`agent-gateway context show`)

Either answers the original as it was sent (text/plain). Another tenant's reference is as absent as one that
never was: a 404, never a 403 that would say it exists.
"""

from __future__ import annotations

from aiohttp import web

from gateway.decision.admission import ANONYMOUS
from gateway.errors import NotFound, StoreUnavailable
from gateway.server.resources import STATE, TENANT
from gateway.store.contract import StoreError


async def _original(request: web.Request, tenant: str) -> web.Response:
    ref = request.match_info["ref"]
    try:
        found = await request.app[STATE].offload.find(tenant, ref)
    except StoreError as exc:
        raise StoreUnavailable("The object store of masked tool outputs is unavailable; retry shortly") from exc
    if found is None:
        raise NotFound(f"No context object {ref!r}: unknown, expired, or not this tenant's")
    return web.Response(body=found, content_type="text/plain", charset="utf-8",
                        headers={"Cache-Control": "private, max-age=86400, immutable"})


async def caller_original(request: web.Request) -> web.Response:
    """`GET /v1/context/{ref}`."""
    return await _original(request, request.get(TENANT) or ANONYMOUS)


async def tenant_original(request: web.Request) -> web.Response:
    """`GET /admin/context/{ref}?tenant=T` (the anonymous tenant's while auth is off)."""
    return await _original(request, request.query.get("tenant") or ANONYMOUS)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/context/{ref}", caller_original)


def add_admin_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/context/{ref}", tenant_original)
