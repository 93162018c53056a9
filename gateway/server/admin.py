"""Operational endpoints: liveness, readiness, metrics, and the token-guarded admin API (explain, policy)."""

from __future__ import annotations

from aiohttp import web

from gateway.accounting.budgets import usage_report
from gateway.apis.routes import BY_ENDPOINT
from gateway.decision.context import gather
from gateway.decision.explain import explanation
from gateway.decision.routing import decide
from gateway.errors import BadRequest, NotFound
from gateway.experiments.shares import export as export_shares
from gateway.policy.tenancy import find_tenant
from gateway.server import pipeline
from gateway.server.resources import ACCOUNTING, DEPLOYMENTS, POLICY, RECENT, SETTINGS, SHARES, TELEMETRY
from gateway.server.scoring import LiveScoring


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    """The client-facing models the policy declares, in a list both the OpenAI and the Anthropic SDKs read."""
    policy = request.app[POLICY].current
    data = [{"id": name, "object": "model", "type": "model", "display_name": name, "owned_by": "agent-gateway",
             "created": 0, "created_at": "1970-01-01T00:00:00Z", "description": model.description}
            for name, model in policy.models.items()]
    names = list(policy.models)
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": names[0] if names else None, "last_id": names[-1] if names else None})


async def readyz(request: web.Request) -> web.Response:
    """Ready when a policy is loaded and a deployment is healthy; otherwise 503 saying why."""
    app = request.app
    policy_file = app[POLICY]
    healthy = sorted(name for name, load in app[DEPLOYMENTS].load.items() if load.healthy)
    problems = []
    if not healthy:
        problems.append("no deployment is healthy: " + ", ".join(
            f"{name} failing health checks or ejected" for name in policy_file.current.deployments))
    described = policy_file.describe()
    if policy_file.last_error is not None:
        where = [_where(problem) for problem in policy_file.last_error.problems]
        problems.append("the last policy reload failed (serving the previous policy): " + "; ".join(where)
                        + " (the details: GET /admin/policy)")
        described["last_reload_error"] = where
    body = {"ready": bool(healthy), "healthy_deployments": healthy, "policy": described, "problems": problems}
    return web.json_response(body, status=200 if healthy else 503)


def _where(problem: str) -> str:
    """A reload problem as /readyz (public) shows it: the file, line and field, never the message or the value
    (`file:line: field: message (value: ...)`, policy/model.py); the admin API shows it whole."""
    where, _, rest = problem.partition(": ")
    field, sep, _ = rest.partition(": ")
    return f"{where}: {field}" if sep and " " not in field.strip("<>") else where


async def metrics(request: web.Request) -> web.Response:
    metrics = request.app[TELEMETRY].metrics
    export_shares(request.app[SHARES], metrics)  # fresh at every scrape, not only at the once-a-second sync
    body = metrics.render()
    # With several workers each scrape is merged from all of them; the header says which one answered.
    return web.Response(body=body, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8",
                                            "x-gateway-worker": str(request.app[SETTINGS].worker_index)})


async def explain_recent(request: web.Request) -> web.Response:
    """The full decision trail of a recent live request, recomputed from its recorded inputs."""
    request_id = request.match_info["request_id"]
    remembered = request.app[RECENT].get(request_id)
    if remembered is None:
        raise NotFound(f"No recent request with id {request_id!r} (only the last "
                       f"{request.app[SETTINGS].explain_memory} are kept)")
    report = explanation(decide(remembered.policy, remembered.features, remembered.ctx, explain=True),
                         remembered.features, remembered.ctx)
    served = remembered.served
    report["served"] = {"deployment": served.deployment, "rule": served.rule, "attempts": list(served.attempts),
                        "reasons": list(served.reasons), "resumes": list(remembered.resumes)}
    return web.json_response(report)


async def explain_body(request: web.Request) -> web.Response:
    """What the live policy would decide for this request body now, without calling any deployment."""
    endpoint = request.query.get("endpoint", "chat")
    adapter = BY_ENDPOINT.get(endpoint)
    if adapter is None:
        raise BadRequest(f"endpoint={endpoint!r} is not one of {', '.join(BY_ENDPOINT)}", param="endpoint")
    call = await pipeline.read(request, adapter)
    # the live path's own gathering, as a dry run: no share observed, no budget or session step counted
    ctx = gather(call, LiveScoring(request.app, observed=False), pipeline.surroundings(request.app, None, None))
    report = explanation(decide(call.policy, call.features, ctx, explain=True), call.features, ctx)
    report["shares"] = request.app[SHARES].describe(call.features.requested_model)
    return web.json_response(report)


async def shares(request: web.Request) -> web.Response:
    """Every rule-routed model's complexity-share targets: the threshold in force and the share observed."""
    tracker = request.app[SHARES]
    return web.json_response({route: tracker.describe(route) for route in sorted(tracker.routes)})


async def usage(request: web.Request) -> web.Response:
    """Spend, tokens and requests per tenant, deployment and window (`?tenant=T` for one tenant), and under
    `limits` the budgets each of those tenants is held to (from the policy: its own entry, else `*`)."""
    store = request.app[ACCOUNTING].store
    report = await usage_report(store, request.query.get("tenant"))
    tenants = request.app[POLICY].current.tenants
    limits = {}
    for name in sorted({row["tenant"] for row in report["data"]}):
        found = find_tenant(tenants, name)
        limits[name] = [] if found is None else [b.model_dump(mode="json", exclude_none=True) for b in found.budgets]
    return web.json_response({**report, "limits": limits})


async def policy_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[POLICY].describe())


async def policy_reload(request: web.Request) -> web.Response:
    policy_file = request.app[POLICY]
    ok = policy_file.reload()
    return web.json_response(policy_file.describe(), status=200 if ok else 422)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/requests/{request_id}/explain", explain_recent)
    router.add_post("/admin/explain", explain_body)
    router.add_get("/admin/policy", policy_status)
    router.add_get("/admin/usage", usage)
    router.add_get("/admin/shares", shares)
    router.add_post("/admin/policy/reload", policy_reload)
