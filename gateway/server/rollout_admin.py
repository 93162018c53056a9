"""The admin API of rollouts and shadows (status, audited actions, history, shadow pairs, policy shadow)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest, NotFound
from gateway.experiments.hook import Experiments
from gateway.rollout import step as rollout
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.server.queries import whole_number
from gateway.server.resources import STATE
from gateway.store.contract import reported_as_unavailable

PAIRS_LIMIT = 10_000

Operation = Callable[[RolloutSpec, RolloutState, str, str, int, float], RolloutState]
OPERATIONS: dict[str, Operation] = {
    "promote": lambda sp, st, a, r, g, now: rollout.promote(sp, st, actor=a, reason=r, generation=g, now=now),
    "promote_full": lambda sp, st, a, r, g, now: rollout.promote_full(
        sp, st, actor=a, reason=r, generation=g, now=now
    ),
    "pause": lambda sp, st, a, r, g, now: rollout.pause(st, actor=a, reason=r, generation=g, now=now),
    "resume": lambda sp, st, a, r, g, now: rollout.resume(sp, st, actor=a, reason=r, generation=g, now=now),
    "abort": lambda sp, st, a, r, g, now: rollout.abort(st, actor=a, reason=r, generation=g, now=now),
    "retry": lambda sp, st, a, r, g, now: rollout.retry(st, actor=a, reason=r, generation=g, now=now),
    "undo": lambda sp, st, a, r, g, now: rollout.undo(sp, st, actor=a, reason=r, generation=g, now=now),
}


def _experiments(request: web.Request) -> Experiments:
    return request.app[STATE].experiments


def _spec(request: web.Request, route: str) -> RolloutSpec:
    policy = request.app[STATE].policy_file.current
    spec = _experiments(request).rollouts.view.index(policy).rollouts.get(route)
    if spec is None:
        routes = ", ".join(r.route or "" for r in policy.rollouts) or "none"
        raise NotFound(
            f"No rollout is declared for route {route!r} (routes with rollouts: {routes})",
            code="rollout_not_found",
        )
    return spec


async def _status(experiments: Experiments, route: str, spec: RolloutSpec) -> dict[str, Any]:
    with reported_as_unavailable("The rollout store"):
        state = await experiments.rollouts.leader.current(route, spec)
        obs = await experiments.rollouts.counters.observe(state)
    return {
        "route": route,
        **rollout.status(spec, state, obs, time.time()),
        "replica": _applied(experiments, spec),
    }


def _applied(experiments: Experiments, spec: RolloutSpec) -> dict[str, Any]:
    """What this replica serves by right now (its last read of the state), to check replicas agree."""
    view, leader = experiments.rollouts.view, experiments.rollouts.leader
    served = view.state(spec)
    return {
        "id": leader.owner,
        "leading": leader.leading,
        "fresh": view.fresh(),
        "generation": None if served is None else served.generation,
        "phase": None if served is None else served.phase.value,
        "weight_pct": 0.0 if served is None else served.weight_pct,
    }


async def list_rollouts(request: web.Request) -> web.Response:
    experiments = _experiments(request)
    specs = experiments.rollouts.view.index(request.app[STATE].policy_file.current).rollouts
    return web.json_response({route: await _status(experiments, route, spec) for route, spec in specs.items()})


async def show_rollout(request: web.Request) -> web.Response:
    route = request.match_info["route"]
    return web.json_response(await _status(_experiments(request), route, _spec(request, route)))


async def history(request: web.Request) -> web.Response:
    route = request.match_info["route"]
    spec = _spec(request, route)
    with reported_as_unavailable("The rollout store"):
        state = await _experiments(request).rollouts.leader.current(route, spec)
    return web.json_response([t.to_dict() for t in state.history])


async def act(request: web.Request) -> web.Response:
    """POST {actor, reason, generation}: the audited manual operation; 409 on a stale generation."""
    route, action = request.match_info["route"], request.match_info["action"]
    operation = OPERATIONS.get(action)
    if operation is None:
        raise NotFound(
            f"Unknown rollout action {action!r}; one of {', '.join(OPERATIONS)}", code="unknown_action"
        )
    spec = _spec(request, route)
    actor, reason, generation = _action_body(await request.read())
    experiments = _experiments(request)
    with reported_as_unavailable("The rollout store"):
        await experiments.rollouts.leader.operate(
            route, spec, lambda st: operation(spec, st, actor, reason, generation, time.time())
        )
    return web.json_response(await _status(experiments, route, spec))


def _action_body(raw: bytes) -> tuple[str, str, int]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise BadRequest("The body must be JSON: {actor, reason, generation}") from None
    if not isinstance(body, dict) or not isinstance(body.get("actor"), str) or not body["actor"]:
        raise BadRequest("`actor` (who acts, recorded in history) is required", param="actor")
    generation = body.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool):
        raise BadRequest(
            "`generation` (the state you acted on, from GET) must be an integer", param="generation"
        )
    reason = body.get("reason") or ""
    if not isinstance(reason, str):
        raise BadRequest("`reason` must be a string", param="reason")
    return body["actor"], reason, generation


async def shadow_pairs(request: web.Request) -> web.StreamResponse:
    """Compared pairs, oldest first: a JSON array, or JSONL with ?format=jsonl (for files and jq)."""
    target = request.query.get("target") or None
    limit = _limit(request)
    with reported_as_unavailable("The shadow pair store"):
        records = await request.app[STATE].stores.pairs.pairs(target, limit)
    return _records(request, records)


async def shadow_labels(request: web.Request) -> web.StreamResponse:
    """Labels of shadow pairs (the labeller's, see docs/learning-loop.md), oldest first: JSON, or JSONL."""
    limit = _limit(request)
    with reported_as_unavailable("The shadow label store"):
        records = await request.app[STATE].stores.labels.labels(limit)
    return _records(request, records)


def _limit(request: web.Request) -> int:
    return whole_number(request.query, "limit", PAIRS_LIMIT, 1, PAIRS_LIMIT)


def _records(request: web.Request, records: list[str]) -> web.Response:
    if request.query.get("format") == "jsonl":
        return web.Response(text="".join(r + "\n" for r in records), content_type="application/x-ndjson")
    return web.Response(text="[" + ",".join(records) + "]", content_type="application/json")


async def policy_shadow(request: web.Request) -> web.Response:
    """The candidate policy's agreement with the live one on this replica, and its recent disagreements."""
    experiments = _experiments(request)
    section = request.app[STATE].policy_file.current.policy_shadow
    return web.json_response(
        {
            "candidate": None if section is None else section.candidate,
            "decisions": dict(experiments.agreement),
            "disagreements": list(experiments.disagreements),
        }
    )


def add_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (server/admin_app.py): each path is under /admin."""
    router.add_get("/rollouts", list_rollouts)
    router.add_get("/rollouts/{route}", show_rollout)
    router.add_get("/rollouts/{route}/history", history)
    router.add_post("/rollouts/{route}/{action}", act)
    router.add_get("/shadow/pairs", shadow_pairs)
    router.add_get("/shadow/labels", shadow_labels)
    router.add_get("/shadow/policy", policy_shadow)
