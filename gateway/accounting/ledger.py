"""A request's part in tenancy: the budget and session verdict, the hold and its settle around the forward."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gateway import openai
from gateway.accounting.budgets import Budgets
from gateway.accounting.keys import KeyRing
from gateway.decision.admission import (
    Admission,
    Cost,
    SessionState,
    TenantSnapshot,
    caps_of,
    costs_of,
    has_soft_limits,
    judge,
    tracks_sessions,
)
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import RateLimited
from gateway.openai import Usage
from gateway.policy.model import Policy
from gateway.policy.tenancy import TenantPolicy, find_tenant
from gateway.store.contract import Reservation, Store
from gateway.telemetry.exchange import Exchange

log = logging.getLogger(__name__)

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
    caps: Mapping[str, int]  # the completion cap to send each deployment, when the request sets none


class Accounting:
    """The process's store, key ring and budgets, for the request path and the admin API."""

    def __init__(self, store: Store, policy: Policy) -> None:
        self.store = store
        self.ring = KeyRing(store)
        self.budgets = Budgets(
            store, reservation_ttl_s=policy.store.reservation_ttl_s, session_ttl_s=policy.sessions.idle_ttl_s
        )

    async def tenant(self, authorization: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header (401 unknown or revoked, 503 store down)."""
        return await self.ring.tenant(authorization)

    async def admit(self, call: Call) -> Admitted:
        """Read the tenant's windows and count this session step (one store call, when needed); judge."""
        policy, features, tenant, body_bytes = call.policy, call.features, call.tenant_or_anonymous, call.body_bytes
        limits = find_tenant(policy.tenants, tenant)
        rules = policy.sessions
        sid = call.session_id if tracks_sessions(rules) else None
        costs = costs_of(policy, features, body_bytes, openai.choices_of(call.view, features.endpoint))
        snapshot, session = TenantSnapshot(tenant, 0.0, {}), None
        if sid is not None or has_soft_limits(limits):
            # hard limits alone need no read: reserve checks them atomically
            seen = await self.budgets.observe(tenant, sid, rules)
            snapshot, session = seen.snapshot, seen.session
        verdict = judge(policy, costs, call.headers, snapshot, session)
        return Admitted(tenant, limits, sid, costs, verdict, session, caps_of(policy, features, body_bytes))

    async def close(self, held: Reservation, policy: Policy, ex: Exchange) -> None:
        """Settle what the deployment reported, or release the hold of a call that generated nothing.

        What was generated is charged, also when the client left or the deployment died mid-stream (the relay
        then counts the streamed tokens); only a call no deployment took is released.
        """
        if ex.usage is not None:
            await self._settle(held, policy, ex)
        else:
            await self.budgets.release(held)

    async def hold(
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
