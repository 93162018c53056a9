"""GET /admin/deployments: each deployment's health and load as the server sees it, and the live shares of
traffic beside their targets (a rule's calibrated `hq_share`, a rollout's weight)."""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import web

from gateway.policy.model import ComplexityShare, Policy
from gateway.server.resources import STATE
from gateway.telemetry.traffic import Counts, shares
from gateway.upstream.deployments import Deployments

NOT_SERVED = "none"  # the deployment label of requests refused before any deployment was tried


async def deployments(request: web.Request) -> web.Response:
    app = request.app
    state = app[STATE]
    policy, settings = state.policy_file.current, state.settings
    metrics, windows = state.metrics, state.traffic
    now = time.time()
    served = windows.requests.read(now, metrics.totals("gateway_requests"))
    arms = windows.arms.read(now, metrics.totals("gateway_rollout_requests"))
    by_deployment = shares(served.by("deployment"), skip=[NOT_SERVED])
    resumes = _resumes_from(metrics.totals("gateway_stream_resumes"))
    return web.json_response({
        "worker": {"index": settings.worker_index, "of": settings.workers, "pid": os.getpid(),
                   "prober": state.deployments.prober},
        "deployments": [{**_deployment(state.deployments, policy, name, by_deployment.get(name, 0.0)),
                         "resumes": resumes.get(name, {})} for name in policy.deployments],
        "shares": {"window_s": served.span_s, "requests": sum(served.by("deployment").values()),
                   "deployments": by_deployment, "rules": shares(served.by("rule"))},
        "targets": [*_share_targets(request, policy), *_rollout_targets(request, policy, arms)],
    })


def _resumes_from(totals: dict[tuple[tuple[str, str], ...], float]) -> dict[str, dict[str, int]]:
    """Streams that broke on each deployment since the start, by what became of them (resumed, failed, refused)."""
    found: dict[str, dict[str, int]] = {}
    for labels, value in totals.items():
        named = dict(labels)
        outcomes = found.setdefault(named.get("from", ""), {})
        outcomes[named.get("outcome", "")] = outcomes.get(named.get("outcome", ""), 0) + int(value)
    return found


def _deployment(deployments: Deployments, policy: Policy, name: str, share: float) -> dict[str, Any]:
    dep, tracked = policy.deployments[name], deployments.tracked(name)
    load = deployments.load.get(name)
    spec = None if tracked is None else tracked.spec_decode
    now = time.monotonic()
    return {
        "name": name,
        "url": dep.url,
        "served_model": dep.served_model,
        "healthy": None if load is None else load.healthy,
        "probe_ok": None if tracked is None else tracked.probe_ok,
        "probed_at": None if tracked is None or not tracked.probed_at else tracked.probed_at,
        "ejected_for_s": 0.0 if tracked is None else round(max(0.0, tracked.ejected_until - now), 3),
        "consecutive_failures": deployments.failures(name),
        "requests_waiting": None if load is None else load.requests_waiting,
        "requests_running": None if load is None else load.requests_running,
        "kv_cache_usage": None if load is None else load.kv_cache_usage,
        "spec_acceptance": None if spec is None else spec.acceptance_ratio,
        "in_flight": deployments.in_flight_now().get(name, 0),
        "max_in_flight": dep.max_in_flight,
        "share": share,
        # the cached input price in effect (the one given, else the fraction of the input price)
        "price": dep.price.model_dump() | {"cached_input_per_mtok_usd": dep.price.cached_per_mtok_usd},
    }


def _share_targets(request: web.Request, policy: Policy) -> list[dict[str, Any]]:
    """Each rule-routed model's `complexity: {hq_share: S}` targets: the share of its calls at or above the live
    threshold (the share the rules send to HQ), beside S."""
    rules: dict[str, list[str]] = {}
    for rule in policy.rules:
        if isinstance(rule.when.complexity, ComplexityShare):
            rules.setdefault(f"{rule.when.complexity.hq_share:g}", []).append(rule.name)
    tracker = request.app[STATE].shares
    return [{"kind": "hq_share", "route": route, "rules": rules.get(share, []), "target": figures["target"],
             "observed": figures["observed"], "threshold": figures["threshold"], "source": figures["source"]}
            for route in sorted(policy.rule_routes) if policy.share_windows
            for share, figures in tracker.describe(route).items()]


def _rollout_targets(request: web.Request, policy: Policy, arms: Counts) -> list[dict[str, Any]]:
    """Each rollout's candidate weight (as this server applies it) against the candidate arm's share."""
    view = request.app[STATE].experiments.rollouts.view
    found = []
    for route, spec in view.index(policy).rollouts.items():
        state = view.state(spec)
        counted = arms.by("arm", where={"route": route})
        total = sum(counted.values())
        found.append({"kind": "rollout", "route": route, "candidate": spec.candidate,
                      "phase": None if state is None else state.phase.value,
                      "target": 0.0 if state is None else state.weight_pct / 100,
                      "observed": counted.get("candidate", 0.0) / total if total else None})
    return found


def add_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (server/admin_app.py): each path is under /admin."""
    router.add_get("/deployments", deployments)
