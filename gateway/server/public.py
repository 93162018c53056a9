"""The public endpoints: liveness, readiness and the Prometheus scrape need no token; the model list is a /v1 call,
behind tenant keys when `auth` is on (like every /v1 call)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from gateway.decision import windows
from gateway.experiments.shares import export as export_shares
from gateway.policy.model import Policy
from gateway.server.resources import STATE


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    """The client-facing models the policy declares, in a list both the OpenAI and the Anthropic SDKs read, each
    with its context window where one is known (docs/windows.md: what to set a coding agent's compaction by)."""
    state = request.app[STATE]
    policy = state.policy_file.current
    learned = state.deployments.windows
    data = [{"id": name, "object": "model", "type": "model", "display_name": name, "owned_by": "agent-gateway",
             "created": 0, "created_at": "1970-01-01T00:00:00Z", "description": model.description,
             **_window(policy, model.pin, learned)}
            for name, model in policy.models.items()]
    names = list(policy.models)
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": names[0] if names else None, "last_id": names[-1] if names else None})


def _window(policy: Policy, pin: str | None, learned: Mapping[str, int]) -> dict[str, int]:
    """The largest prompt the model's calls can be served with, in its deployments' tokens: the pinned deployment's
    window, or a routed model's widest (a step too long for one deployment goes to one it fits)."""
    names = [pin] if pin is not None else list(policy.deployments)
    known = [w for n in names if (w := windows.window_of(policy.deployments[n].max_model_len, learned.get(n)))]
    return {"context_window": max(known), "max_model_len": max(known)} if known else {}


async def readyz(request: web.Request) -> web.Response:
    """Ready when a policy is loaded and a deployment is healthy; otherwise 503 saying why."""
    app = request.app
    state = app[STATE]
    policy_file = state.policy_file
    healthy = sorted(name for name, load in state.deployments.load.items() if load.healthy)
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
    state = request.app[STATE]
    metrics = state.metrics
    export_shares(state.shares, metrics)  # fresh at every scrape, not only at the once-a-second sync
    body = metrics.render()
    # With several workers each scrape is merged from all of them; the header says which one answered.
    return web.Response(body=body, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8",
                                            "x-gateway-worker": str(state.settings.worker_index)})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/models", models)
    router.add_get("/", healthz)  # Claude Code checks the base URL with a HEAD / first
    router.add_get("/healthz", healthz)
    router.add_get("/readyz", readyz)
    router.add_get("/metrics", metrics)
