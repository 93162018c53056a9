"""The task outcome API: a caller reports how its agent run ended, and operators read the outcome figures.

    POST /v1/sessions/{session_id}/outcome   {"success": bool, "score": 0..1, "reason": str, "labels": {str: str}}
        -> {"object": "session.outcome", "session_id", "outcome", "replaced", "outcome_history"}
        404 `session_not_found` for a session the caller's tenant has not recorded (another tenant's, an
        unknown one, or one idle past agents.record.ttl_s), `session_ambiguous` for an id that names two of
        its sessions: nothing is written
    GET /admin/outcomes?tenant=T
        -> {"object": "list", "data": [{route, mix, arm, sessions, successes, success_rate,
            cost_per_session_usd, cost_per_success_usd, cost_per_successful_session_usd, steps_per_success}],
            "sessions_read": N}

`session_id` is the id the run's client sent (`x-session-id`, or its agent's session header), as `sessions list`
shows it (agents/session_ids.py maps it to the stored session).
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.agents import outcomes as oc
from gateway.agents.trajectory import RANKED_SCAN
from gateway.apis import json_body
from gateway.decision.admission import ANONYMOUS
from gateway.errors import NotFound, PayloadTooLarge
from gateway.server.resources import STATE, TENANT
from gateway.store.contract import reported_as_unavailable

log = logging.getLogger(__name__)

BODY_MAX_BYTES = 16 * 1024  # an outcome is a few fields; labels and reason are bounded well below this


async def report(request: web.Request) -> web.Response:
    given = request.match_info["session_id"]
    outcome = oc.read_body(json_body.decode(await _body(request)))
    tenant = request.get(TENANT) or ANONYMOUS
    trajectories = request.app[STATE].trajectories
    with reported_as_unavailable("The trajectory store"):
        ref = await trajectories.locate(given, tenant, settled=True)
        summary = await trajectories.outcomes.report(ref, outcome)
    if summary is None or summary.outcome is None:  # forgotten between the two reads
        raise NotFound(f"No recorded agent session {given!r} of this caller (sessions idle longer than the "
                       "policy's agents.record.ttl_s are forgotten)", param="session_id", code="session_not_found")
    shown = summary.to_dict()
    if summary.replaced:
        log.info("session %r (tenant %r): outcome %s replaces %s", shown["session_id"], tenant,
                 summary.outcome.word, summary.replaced[-1].word)
    return web.json_response({"object": "session.outcome", "session_id": shown["session_id"],
                              "outcome": shown["outcome"], "replaced": bool(summary.replaced),
                              "outcome_history": shown["outcome_history"]})


async def _body(request: web.Request) -> bytes:
    raw = await request.content.read(BODY_MAX_BYTES + 1)
    if len(raw) > BODY_MAX_BYTES:
        raise PayloadTooLarge(f"An outcome body is at most {BODY_MAX_BYTES} bytes")
    return raw


async def figures(request: web.Request) -> web.Response:
    """Outcome figures over the most recently active sessions (the store's, so every replica's)."""
    with reported_as_unavailable("The trajectory store"):
        found = await request.app[STATE].trajectories.store.sessions(request.query.get("tenant") or None, RANKED_SCAN)
    reported = [(s.route or "none", oc.mix(s.deployments), s.membership.cohort if s.membership else "none",
                 s.outcome) for s in found if s.outcome is not None]
    return web.json_response({"object": "list", "data": [r.to_dict() for r in oc.rows(reported)],
                              "sessions_read": len(found)})


async def _wire(app: web.Application) -> None:
    """Outcomes of sessions measured in a rollout cohort count toward its guards."""
    state = app[STATE]
    state.trajectories.count_outcomes_in(state.experiments.cohort_counters)


def install(app: web.Application) -> None:
    """The caller's route, and the wiring of outcomes to the rollouts once create_app's resources exist."""
    app.router.add_post("/v1/sessions/{session_id}/outcome", report)
    app.on_startup.append(_wire)


def add_admin_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (server/admin_app.py): GET /admin/outcomes."""
    router.add_get("/outcomes", figures)
