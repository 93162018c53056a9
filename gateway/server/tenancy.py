"""Tenant auth: with `auth` on in the policy, a call to the client API (/v1/) names its tenant by its API key,
or is refused with a 401 (the admin API has its own check: server/admin_app.py). The key itself is never logged."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.server.resources import STATE, TENANT


def tenant_middleware(app: web.Application) -> Middleware:
    """The middleware of `app` (its policy and accounting are read at each request: they exist once it started)."""

    @web.middleware
    async def tenant(request: web.Request, handler: Handler) -> web.StreamResponse:
        state = app[STATE]
        if request.path.startswith("/v1/") and state.policy_file.current.auth.enabled:
            request[TENANT] = await state.accounting.tenant(credential(request))
        return await handler(request)

    return tenant


def credential(request: web.Request) -> str | None:
    """The API key as a bearer credential: OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key`."""
    given = request.headers.get("authorization")
    if given is None and "x-api-key" in request.headers:
        given = "Bearer " + request.headers["x-api-key"]
    return given
