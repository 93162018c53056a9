"""Operational endpoints: liveness, readiness, metrics, and the token-guarded admin API (explain, policy)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway import openai
from gateway.accounting.budgets import usage_report
from gateway.decision.routing import decide
from gateway.errors import GatewayError, NotFound
from gateway.features import extract
from gateway.server.exchange import SERVICES


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when a policy is loaded and a deployment is healthy; otherwise 503 saying why."""
    svc = request.app[SERVICES]
    healthy = sorted(name for name, load in svc.backends.load.items() if load.healthy)
    problems = []
    if not healthy:
        problems.append("no deployment is healthy: " + ", ".join(
            f"{name} failing health checks or ejected" for name in svc.policy.current.deployments))
    if svc.policy.last_error is not None:
        problems.append("the last policy reload failed (serving the previous policy): "
                        + "; ".join(svc.policy.last_error.problems))
    body = {"ready": bool(healthy), "healthy_deployments": healthy, "policy": svc.policy.describe(),
            "problems": problems}
    return web.json_response(body, status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICES].metrics.render()
    return web.Response(body=body, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})


async def explain_recent(request: web.Request) -> web.Response:
    """The full decision trail of a recent live request, recomputed from its recorded inputs."""
    svc = request.app[SERVICES]
    request_id = request.match_info["request_id"]
    remembered = svc.recent.get(request_id)
    if remembered is None:
        raise NotFound(f"No recent request with id {request_id!r} (only the last "
                       f"{svc.settings.explain_memory} are kept)")
    policy, features, ctx = remembered
    return web.json_response(explanation(decide(policy, features, ctx, explain=True), features, ctx))


async def explain_body(request: web.Request) -> web.Response:
    """What the live policy would decide for this request body now, without calling any deployment."""
    svc = request.app[SERVICES]
    endpoint = request.query.get("endpoint", "chat")
    body = openai.decode(await request.read())
    openai.check(body, endpoint)
    policy = svc.policy.current
    features = extract(body, endpoint)
    ctx = svc.context(request, features, policy)
    return web.json_response(explanation(decide(policy, features, ctx, explain=True), features, ctx))


def explanation(decision: Any, features: Any, ctx: Any) -> dict[str, Any]:
    return {
        "deployment": decision.deployment,
        "rule": decision.rule,
        "attempts": list(decision.attempts),
        "reasons": list(decision.reasons),
        "complexity": ctx.complexity,
        "admission": None if ctx.admission is None else {
            "allowed": sorted(ctx.admission.allowed), "prefer": ctx.admission.prefer,
            "limit": ctx.admission.limit, "reasons": list(ctx.admission.reasons)},
        "features": {k: getattr(features, k) for k in features.__slots__ if k != "last_user_text"},
        "load": {name: {"healthy": load.healthy, "requests_waiting": load.requests_waiting,
                        "requests_running": load.requests_running, "kv_cache_usage": load.kv_cache_usage}
                 for name, load in ctx.load.items()},
    }


async def usage(request: web.Request) -> web.Response:
    """Spend, tokens and requests per tenant, deployment and window (`?tenant=T` for one tenant)."""
    accounting = request.app[SERVICES].accounting
    if accounting is None:
        raise GatewayError("The store is not open")
    return web.json_response(await usage_report(accounting.store, request.query.get("tenant")))


async def policy_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICES].policy.describe())


async def policy_reload(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    ok = svc.policy.reload()
    return web.json_response(svc.policy.describe(), status=200 if ok else 422)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/requests/{request_id}/explain", explain_recent)
    router.add_post("/admin/explain", explain_body)
    router.add_get("/admin/policy", policy_status)
    router.add_get("/admin/usage", usage)
    router.add_post("/admin/policy/reload", policy_reload)
