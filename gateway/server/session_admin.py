"""The agent sessions admin API: recorded trajectories as JSON (the `sessions` CLI and the /ui page read it).

    GET /admin/sessions?tenant=T&sort=cost|steps|rate|recent&limit=N
        -> {"object": "list", "data": [summary, ...]}
    GET /admin/sessions/{session_id}[?tenant=T]
        -> {summary fields..., "steps": [step, ...], "step_count": N}    404 `session_not_found` when unknown

(In the one session's view `steps` is the list of recorded steps, the last max_steps_per_session of them;
the summary's count of all steps is `step_count` there.)
"""

from __future__ import annotations

from aiohttp import web

from gateway.decision.trajectory import SORTS, ranked
from gateway.errors import BadRequest, NotFound
from gateway.server.resources import TRAJECTORIES
from gateway.store.contract import reported_as_unavailable

LIMIT_DEFAULT = 50
LIMIT_MAX = 1000
SCAN_MAX = 5000  # sessions read to rank by cost, steps or rate: the most recently active ones


async def sessions(request: web.Request) -> web.Response:
    query = request.query
    sort = query.get("sort", "recent")
    if sort not in SORTS:
        raise BadRequest(f"sort must be one of {', '.join(SORTS)}, got {sort[:32]!r}", param="sort")
    limit = _limit(query.get("limit"))
    store = request.app[TRAJECTORIES].store
    with reported_as_unavailable("The trajectory store"):
        found = await store.sessions(query.get("tenant") or None, limit if sort == "recent" else SCAN_MAX)
    return web.json_response({"object": "list", "data": [s.to_dict() for s in ranked(found, sort, limit)]})


def _limit(raw: str | None) -> int:
    if raw is None:
        return LIMIT_DEFAULT
    if not raw.isdigit() or not 1 <= int(raw) <= LIMIT_MAX:
        raise BadRequest(f"limit must be a whole number from 1 to {LIMIT_MAX}, got {raw[:32]!r}", param="limit")
    return int(raw)


async def session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    store = request.app[TRAJECTORIES].store
    with reported_as_unavailable("The trajectory store"):
        found = await store.session(session_id, request.query.get("tenant") or None)
    if found is None:
        raise NotFound(f"No recorded agent session {session_id!r} (sessions idle longer than the policy's "
                       "agents.record.ttl_s, or beyond max_sessions, are forgotten)", param="session_id",
                       code="session_not_found")
    summary, steps = found
    shown = summary.to_dict()
    return web.json_response({**shown, "steps": [s.shown() for s in steps], "step_count": shown["steps"]})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/sessions", sessions)
    router.add_get("/admin/sessions/{session_id:.+}", session)
