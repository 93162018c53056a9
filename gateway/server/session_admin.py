"""The agent sessions admin API: recorded trajectories as JSON (the `sessions` CLI and the /ui page read it).

    GET /admin/sessions?tenant=T&sort=cost|steps|rate|recent&limit=N
        -> {"object": "list", "data": [summary, ...]}
    GET /admin/sessions/{session_id}[?tenant=T]
        -> {summary fields..., "steps": [step, ...], "step_count": N}    404 `session_not_found` when unknown

A session is named by its tenant and its id (two tenants may both send `x-session-id: run-1`): the page
always sends `tenant`; without it the most recently active session of that id is shown.

(In the one session's view `steps` is the list of recorded steps, the last max_steps_per_session of them;
the summary's count of all steps is `step_count` there.)
"""

from __future__ import annotations

from aiohttp import web

from gateway.decision.trajectory import SORTS
from gateway.errors import BadRequest, NotFound
from gateway.server.queries import whole_number
from gateway.server.resources import TRAJECTORIES
from gateway.store.contract import reported_as_unavailable

LIMIT_DEFAULT = 50
LIMIT_MAX = 1000


async def sessions(request: web.Request) -> web.Response:
    query = request.query
    sort = query.get("sort", "recent")
    if sort not in SORTS:
        raise BadRequest(f"sort must be one of {', '.join(SORTS)}, got {sort[:32]!r}", param="sort")
    limit = whole_number(query, "limit", LIMIT_DEFAULT, 1, LIMIT_MAX)
    store = request.app[TRAJECTORIES].store
    with reported_as_unavailable("The trajectory store"):
        found = await store.sessions(query.get("tenant") or None, limit, sort)
    return web.json_response({"object": "list", "data": [s.to_dict() for s in found]})


async def session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    tenant = request.query.get("tenant") or None
    store = request.app[TRAJECTORIES].store
    with reported_as_unavailable("The trajectory store"):
        found = await store.session(session_id, tenant)
    if found is None:
        of = f" of tenant {tenant!r}" if tenant is not None else ""
        raise NotFound(f"No recorded agent session {session_id!r}{of} (sessions idle longer than the policy's "
                       "agents.record.ttl_s, or beyond max_sessions, are forgotten)", param="session_id",
                       code="session_not_found")
    summary, steps = found
    shown = summary.to_dict()
    return web.json_response({**shown, "steps": [s.shown() for s in steps], "step_count": shown["steps"]})


def add_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (server/admin_app.py): each path is under /admin."""
    router.add_get("/sessions", sessions)
    router.add_get("/sessions/{session_id:.+}", session)
