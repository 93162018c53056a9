"""The gateway app's middleware chain, outermost first; each does one job and the order is what makes them work:

    exchange   (server/exchanges.py)  request id; an API call's span, metrics and decision headers. Outermost,
                                      so it sees the status the client got, error or not, and a client close.
    envelope   (server/envelope.py)   every error in its API's envelope: the one translation of errors. Inside
                                      the exchange (whose record it marks), outside every check.
    tenant     (server/tenancy.py)    /v1/ calls: the API key -> the tenant (a 401 when the policy's auth is on).

The admin API is a sub-app at /admin/ (server/admin_app.py) whose own middleware, admin_auth, runs after these.
The exchange and tenant middlewares are made for their app, whose resources they read without a lookup through
each request (`request.app` is a property of a property): this chain costs no more per request than the one
middleware it replaced did (timed around a trivial handler).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.server.envelope import envelope_middleware
from gateway.server.exchanges import exchange_middleware
from gateway.server.tenancy import tenant_middleware


def chain(app: web.Application) -> list[Middleware]:
    return [exchange_middleware(app), envelope_middleware, tenant_middleware(app)]
