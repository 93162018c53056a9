"""A request's part in tenancy: its tenant, the budget and session verdict, the hold and its settle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from gateway.accounting.budgets import Budgets, worst_case
from gateway.accounting.keys import KeyRing
from gateway.decision.routing import Decision
from gateway.decision.sessions import session_id
from gateway.errors import BadRequest, RateLimited
from gateway.features import Features
from gateway.openai import Usage
from gateway.policy.model import Policy
from gateway.policy.tenancy import (
    Admission,
    Cost,
    SessionPolicy,
    SessionState,
    TenantPolicy,
    TenantSnapshot,
    admission,
    find_tenant,
)
from gateway.server.exchange import SERVICES, TENANT, Exchange
from gateway.settings import Settings
from gateway.store.fallback import FallbackStore, open_store
from gateway.store.redis_store import Reservation, Store

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the tenant of every request while auth is off
MAX_COST_HEADER = "x-gateway-max-cost-usd"
# Chat templates wrap each message in role and separator tokens that the prompt's text count misses.
TEMPLATE_TOKENS_PER_MESSAGE = 8
RESERVE_MARGIN_S = 60.0  # a hold outlives its request's total timeout by this much


@dataclass(slots=True)
class Admitted:
    """What admission found for one request; the forward holds, then settles or releases, against it."""

    tenant: str
    limits: TenantPolicy | None
    session_id: str | None
    costs: Mapping[str, Cost]
    verdict: Admission
    session: SessionState | None


def steered(policy: Policy, headers: Mapping[str, str]) -> bool:
    """Whether this request needs admission at all: tenancy is configured, or it caps its own cost."""
    return policy.accounted or MAX_COST_HEADER in headers


class Accounting:
    """The process's store, key ring and budgets, for the request path and the admin API."""

    def __init__(self, store: Store, registry: CollectorRegistry, policy: Policy) -> None:
        self.store = store
        self.ring = KeyRing(store)
        self.budgets = Budgets(
            store, reservation_ttl_s=policy.store.reservation_ttl_s, session_ttl_s=policy.sessions.idle_ttl_s
        )
        _export_store(store, registry)

    async def tenant(self, authorization: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header (401 unknown or revoked, 503 store down)."""
        return await self.ring.tenant(authorization)

    async def admit(
        self,
        request: web.Request,
        policy: Policy,
        features: Features,
        body: Mapping[str, Any],
        body_bytes: int,
    ) -> Admitted:
        """Read the tenant's windows and count this session step (one store call, when needed); judge."""
        tenant = request.get(TENANT) or ANONYMOUS
        limits = find_tenant(policy.tenants, tenant)
        rules = policy.sessions
        sid = session_id(request.headers, body) if _session_rules(rules) else None
        costs = costs_of(policy, features, body_bytes)
        snapshot, session = TenantSnapshot(tenant, 0.0, {}), None
        if sid is not None or _has_soft(limits):
            # hard limits alone need no read: reserve checks them atomically
            seen = await self.budgets.observe(tenant, sid, rules)
            snapshot, session = seen.snapshot, seen.session
        verdict = judge(policy, costs, request.headers, snapshot, session)
        return Admitted(tenant, limits, sid, costs, verdict, session)

    async def follow(
        self,
        admitted: Admitted,
        policy: Policy,
        decision: Decision,
        ex: Exchange,
        forward: Callable[[Decision], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Hold the worst case, forward, then settle the usage the deployment reported or release the hold."""
        if not policy.accounted:
            return await forward(decision)  # only a cost-cap header steered this request: nothing to account
        held, decision = await self._hold(admitted, policy, decision)
        settled = False
        try:
            response = await forward(decision)
            settled = ex.usage is not None
            return response
        finally:
            # shielded: a client that disconnects cancels the handler, and the hold must still be freed
            done = self._settle(held, policy, ex) if settled else self.budgets.release(held)
            await asyncio.shield(done)

    async def _hold(
        self, admitted: Admitted, policy: Policy, decision: Decision
    ) -> tuple[Reservation, Decision]:
        """Hold the largest worst case among the deployments failover may try, else the chosen one's alone."""
        widest = max((admitted.costs[name] for name in decision.attempts), key=lambda c: c.usd)
        try:
            return await self._reserve(admitted, policy, decision, widest), decision
        except RateLimited as exc:
            own = admitted.costs[decision.deployment]
            if exc.code != "budget_exceeded" or own.usd >= widest.usd:
                raise
        # near a hard limit the chosen deployment may still fit where its failover would not
        alone = dataclasses.replace(
            decision,
            attempts=(decision.deployment,),
            reasons=(*decision.reasons, "budget: no failover (its worst case does not fit)"),
        )
        return await self._reserve(admitted, policy, alone, own), alone

    async def _reserve(
        self, admitted: Admitted, policy: Policy, decision: Decision, cost: Cost
    ) -> Reservation:
        total_s = sum(policy.deployments[name].timeouts.total_s for name in decision.attempts)
        return await self.budgets.reserve(
            admitted.tenant,
            admitted.limits,
            decision.deployment,
            cost,
            session_id=admitted.session_id,
            ttl_s=total_s + RESERVE_MARGIN_S,
        )

    async def _settle(self, held: Reservation, policy: Policy, ex: Exchange) -> None:
        usage: Usage | None = ex.usage
        answered = ex.deployment if ex.deployment in policy.deployments else held.deployment
        assert usage is not None
        price = policy.deployments[answered].price
        tokens_in, tokens_out = usage.prompt_tokens, usage.completion_tokens
        await self.budgets.settle(held, price, tokens_in, tokens_out, deployment=answered)


def judge(
    policy: Policy,
    costs: Mapping[str, Cost],
    headers: Mapping[str, str],
    snapshot: TenantSnapshot,
    session: SessionState | None = None,
) -> Admission:
    """The verdict for a tenant in `snapshot` (pure: `policy explain` calls it with assumed figures)."""
    limits = find_tenant(policy.tenants, snapshot.tenant)
    cap = _max_cost(headers)
    return admission(snapshot, limits, costs, session=session, sessions=policy.sessions, max_cost_usd=cap)


def _session_rules(rules: SessionPolicy) -> bool:
    return rules.pin or rules.tight_loop_steps_per_min is not None or rules.cost_cap_usd is not None


def _has_soft(limits: TenantPolicy | None) -> bool:
    if limits is None:
        return False
    return any(b.soft_usd is not None or b.soft_tokens is not None for b in limits.budgets)


def costs_of(policy: Policy, features: Features, body_bytes: int) -> dict[str, Cost]:
    """Each deployment's worst case for this request: an upper bound on its prompt, max_tokens out."""
    if features.prompt_tokens_exact:
        prompt = features.prompt_tokens + TEMPLATE_TOKENS_PER_MESSAGE * (features.message_count + 1)
    else:
        prompt = body_bytes  # an estimate is not a bound; no tokenizer makes more tokens than bytes
    return {name: worst_case(dep, prompt, features.max_tokens) for name, dep in policy.deployments.items()}


def _max_cost(headers: Mapping[str, str]) -> float | None:
    raw = headers.get(MAX_COST_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise BadRequest(
            f"{MAX_COST_HEADER} must be a non-negative number of USD, got {raw[:32]!r}",
            param=MAX_COST_HEADER,
            code="invalid_header",
        )
    return value


def _export_store(store: Store, registry: CollectorRegistry) -> None:
    """Gauges read at scrape time: whether the shared store is down, and settles waiting to reach it."""
    fallback = store if isinstance(store, FallbackStore) else None
    Gauge(
        "gateway_store_degraded", "1 while the shared store (Redis) is unreachable", registry=registry
    ).set_function(lambda: float(fallback is not None and fallback.degraded))
    Gauge(
        "gateway_store_pending_settles",
        "Settles kept locally until the shared store answers again",
        registry=registry,
    ).set_function(lambda: float(fallback.pending_settles if fallback else 0))
    Gauge(
        "gateway_store_dropped_settles",
        "Settles dropped because the pending queue was full",
        registry=registry,
    ).set_function(lambda: float(fallback.dropped_settles if fallback else 0))


def lifecycle(settings: Settings) -> Callable[[web.Application], AsyncIterator[None]]:
    """create_app's cleanup context for the store: in memory, or Redis (the policy's, else the env's)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        svc = app[SERVICES]
        policy = svc.policy.current
        section = policy.store
        if section.redis_url is None and settings.redis_url:
            section = section.model_copy(update={"redis_url": settings.redis_url})
        store = open_store(section)
        svc.accounting = Accounting(store, svc.metrics.registry, policy)
        try:
            yield
        finally:
            svc.accounting = None
            await store.close()

    return ctx
