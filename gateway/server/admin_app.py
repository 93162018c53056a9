"""The admin API: every path under /admin/, one aiohttp sub-app behind the one admin check.

    app.add_subapp("/admin/", create_admin_app())     # by mount(app), from create_app

A request under /admin/ runs the gateway app's middleware chain (server/middleware.py: its id, the error
envelope) and then admin_auth: `accounting.keys.check_admin` against the policy's `auth.admin_token_env`
(403 while no token is set, 401 without the right one), for every path, an unknown one too (it is then a 404).

The sub-app holds the gateway's state object itself (server/resources.py), so its handlers, and the pipeline
stages they reuse (`POST /admin/explain` reads a body as the live path does), read `request.app[STATE]` like every
other handler.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.accounting.keys import check_admin
from gateway.server import admin, context_api, deployment_admin, outcome_api, rollout_admin, session_admin
from gateway.server.resources import STATE

PREFIX = "/admin/"


@web.middleware
async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    check_admin(request.headers.get("authorization"), state.policy_file.current.auth, state.settings.admin_token)
    return await handler(request)


def create_admin_app() -> web.Application:
    admin_app = web.Application(middlewares=[admin_auth])
    for add_routes in (admin.add_routes, rollout_admin.add_routes, session_admin.add_routes,
                       deployment_admin.add_routes, outcome_api.add_admin_routes, context_api.add_admin_routes):
        add_routes(admin_app.router)
    return admin_app


def mount(app: web.Application) -> None:
    """The admin sub-app at /admin/, sharing the gateway's state."""

    admin_app = create_admin_app()
    admin_app[STATE] = app[STATE]  # the very object, whose resources the gateway's cleanup contexts set
    # `/admin` itself is no admin path (the sub-app's prefix would take it): unknown, without the check.
    app.router.add_route("*", PREFIX.rstrip("/"), _unknown)
    app.add_subapp(PREFIX, admin_app)


async def _unknown(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()
