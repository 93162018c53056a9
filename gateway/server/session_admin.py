"""The agent sessions admin API: recorded trajectories as JSON (the `sessions` CLI and the /ui page read it).

    GET /admin/sessions?tenant=T&sort=cost|steps|rate|recent&limit=N
        -> {"object": "list", "data": [summary, ...]}
    GET /admin/sessions/{session_id}[?tenant=T]
        -> {summary fields..., "steps": [step, ...], "step_count": N}    404 `session_not_found` when unknown,
           `session_ambiguous` when the id names several sessions (two tenants', without `tenant`)

A session goes by the id its client sent (`x-session-id: run-1` is `run-1`; one no client named by the gateway's
name for it, p:… or r:…: agents/session_ids.py) and its tenant (two tenants may both send `run-1`): the page
always sends `tenant`; without it the id must name one tenant's session.

(In the one session's view `steps` is the list of recorded steps, the last max_steps_per_session of them;
the summary's count of all steps is `step_count` there.)
"""

from __future__ import annotations

from aiohttp import web

from gateway.agents.trajectory import SORTS
from gateway.errors import BadRequest, NotFound
from gateway.server.queries import whole_number
from gateway.server.resources import STATE
from gateway.store.contract import reported_as_unavailable

LIMIT_DEFAULT = 50
LIMIT_MAX = 1000


async def sessions(request: web.Request) -> web.Response:
    query = request.query
    sort = query.get("sort", "recent")
    if sort not in SORTS:
        raise BadRequest(f"sort must be one of {', '.join(SORTS)}, got {sort[:32]!r}", param="sort")
    limit = whole_number(query, "limit", LIMIT_DEFAULT, 1, LIMIT_MAX)
    store = request.app[STATE].trajectories.store
    with reported_as_unavailable("The trajectory store"):
        found = await store.sessions(query.get("tenant") or None, limit, sort)
    return web.json_response({"object": "list", "data": [s.to_dict() for s in found]})


async def session(request: web.Request) -> web.Response:
    given = request.match_info["session_id"]
    trajectories = request.app[STATE].trajectories
    with reported_as_unavailable("The trajectory store"):
        tenant, session_id = await trajectories.locate(given, request.query.get("tenant") or None)
        found = await trajectories.store.session(session_id, tenant)
    if found is None:  # forgotten between the two reads
        raise NotFound(f"No recorded agent session {given!r} of tenant {tenant!r}", param="session_id",
                       code="session_not_found")
    summary, steps = found
    shown = summary.to_dict()
    return web.json_response({**shown, "steps": [s.shown() for s in steps], "step_count": shown["steps"]})


def add_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (server/admin_app.py): each path is under /admin."""
    router.add_get("/sessions", sessions)
    router.add_get("/sessions/{session_id:.+}", session)
