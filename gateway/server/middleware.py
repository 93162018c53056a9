"""The gateway app's middleware chain, outermost first; each does one job and the order is what makes them work:

    exchange_middleware   (server/exchanges.py)  request id; an API call's span, metrics and decision headers.
                          Outermost, so it sees the status the client got, error or not, and a client close.
    envelope_middleware   (server/envelope.py)   every error as its API's envelope, the one translation of errors.
                          Inside the exchange (which names the request's API for it), outside every check.
    tenant_middleware     (server/tenancy.py)    /v1/ calls: the API key -> the tenant (a 401 when auth is on).

The admin API is a sub-app at /admin/ (server/admin_app.py) whose own middleware, admin_auth, runs after these.
"""

from __future__ import annotations

from aiohttp.typedefs import Middleware

from gateway.server.envelope import envelope_middleware
from gateway.server.exchanges import add_gateway_headers, exchange_middleware
from gateway.server.tenancy import tenant_middleware

__all__ = ["CHAIN", "add_gateway_headers"]  # add_gateway_headers: relay.py's import, until it imports exchanges

CHAIN: tuple[Middleware, ...] = (exchange_middleware, envelope_middleware, tenant_middleware)
