"""The admin API's own endpoints: explain (a recent request, a body), the policy (status, reload), usage, shares.

Mounted under /admin/ with the rest of the admin API by server/admin_app.py, behind its token check."""

from __future__ import annotations

from aiohttp import web

from gateway.accounting.budgets import usage_report
from gateway.apis.routes import BY_ENDPOINT
from gateway.decision.explain import explanation
from gateway.decision.gathering import gather
from gateway.decision.routing import decide
from gateway.errors import BadRequest, NotFound
from gateway.policy.tenancy import find_tenant
from gateway.server import pipeline
from gateway.server.live_scores import LiveScoring
from gateway.server.resources import STATE


async def explain_recent(request: web.Request) -> web.Response:
    """The full decision trail of a recent live request, recomputed from its recorded inputs."""
    state = request.app[STATE]
    request_id = request.match_info["request_id"]
    remembered = state.recent.get(request_id)
    if remembered is None:
        raise NotFound(f"No recent request with id {request_id!r} (only the last "
                       f"{state.settings.explain_memory} are kept)")
    report = explanation(decide(remembered.policy, remembered.features, remembered.ctx, explain=True),
                         remembered.features, remembered.ctx, remembered.context, remembered.masking)
    if remembered.context_notes:
        report.setdefault("context", {}).update(remembered.context_notes)
    served = remembered.served
    report["served"] = {"deployment": served.deployment, "rule": served.rule, "attempts": list(served.attempts),
                        "reasons": list(served.reasons), "resumes": list(remembered.resumes),
                        "compactions": list(remembered.compactions)}
    return web.json_response(report)


async def explain_body(request: web.Request) -> web.Response:
    """What the live policy would decide for this request body now, without calling any deployment."""
    state = request.app[STATE]
    endpoint = request.query.get("endpoint", "chat")
    adapter = BY_ENDPOINT.get(endpoint)
    if adapter is None:
        raise BadRequest(f"endpoint={endpoint!r} is not one of {', '.join(BY_ENDPOINT)}", param="endpoint")
    call = await pipeline.read(request, adapter)
    # the live path's own gathering, as a dry run: no share observed, no budget or session step counted
    sighting = await state.session_caches.sighting(call)  # read only: nothing is recorded as served
    ctx = gather(call, LiveScoring(request.app, observed=False),
                 pipeline.surroundings(request.app, None, None, sighting))
    report = explanation(decide(call.policy, call.features, ctx, explain=True), call.features, ctx, call.context,
                         call.masking)
    report["shares"] = state.shares.describe(call.features.requested_model)
    return web.json_response(report)


async def shares(request: web.Request) -> web.Response:
    """Every rule-routed model's complexity-share targets: the threshold in force and the share observed."""
    tracker = request.app[STATE].shares
    return web.json_response({route: tracker.describe(route) for route in sorted(tracker.routes)})


async def usage(request: web.Request) -> web.Response:
    """Spend, tokens and requests per tenant, deployment and window (`?tenant=T` for one tenant), and under
    `limits` the budgets each of those tenants is held to (from the policy: its own entry, else `*`)."""
    state = request.app[STATE]
    store = state.accounting.store
    report = await usage_report(store, request.query.get("tenant"))
    tenants = state.policy_file.current.tenants
    limits = {}
    for name in sorted({row["tenant"] for row in report["data"]}):
        found = find_tenant(tenants, name)
        limits[name] = [] if found is None else [b.model_dump(mode="json", exclude_none=True) for b in found.budgets]
    return web.json_response({**report, "limits": limits})


async def policy_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].policy_file.describe())


async def policy_reload(request: web.Request) -> web.Response:
    policy_file = request.app[STATE].policy_file
    ok = policy_file.reload()
    return web.json_response(policy_file.describe(), status=200 if ok else 422)


def add_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app: each path is under /admin (`/policy` is GET /admin/policy)."""
    router.add_get("/requests/{request_id}/explain", explain_recent)
    router.add_post("/explain", explain_body)
    router.add_get("/policy", policy_status)
    router.add_get("/usage", usage)
    router.add_get("/shares", shares)
    router.add_post("/policy/reload", policy_reload)
