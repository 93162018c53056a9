"""A request's part in tenancy: the budget and session verdict, the hold and its settle around the forward."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.accounting.budgets import Budgets
from gateway.accounting.keys import KeyRing
from gateway.apis.chat import wire as chat_wire
from gateway.apis.routes import RESUMABLE
from gateway.apis.usage import Usage
from gateway.decision.admission import (
    Admission,
    Cost,
    PromptSize,
    SessionState,
    TenantSnapshot,
    costs_of,
    fit_room,
    has_soft_limits,
    judge,
    measure_prompt,
    output_plan,
    prompt_size,
    room_depends_on_count,
    tracks_sessions,
)
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import RateLimited
from gateway.features import Features
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
    caps: Mapping[str, int]  # the output cap per choice to send each deployment: the one its hold assumed
    may_resume: bool = False  # a stream the sibling may finish (policy `resume`): it re-reads the answer so far


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
        prompt = await _prompt_size(policy, features, call.view, body_bytes)
        plan = output_plan(policy, features, prompt)
        choices = chat_wire.choices_of(call.view, features.endpoint)
        costs = costs_of(policy, features, body_bytes, choices, prompt=prompt)
        snapshot, session = TenantSnapshot(tenant, 0.0, {}), None
        if sid is not None or has_soft_limits(limits):
            # hard limits alone need no read: reserve checks them atomically
            seen = await self.budgets.observe(tenant, sid, rules)
            snapshot, session = seen.snapshot, seen.session
        verdict = fit_room(judge(policy, costs, call.headers, snapshot, session), plan, policy, features)
        may_resume = bool(features.stream) and features.endpoint in RESUMABLE and \
            policy.resume_for(features.requested_model).enabled
        return Admitted(tenant, limits, sid, costs, verdict, session, plan.caps, may_resume)

    async def close(self, held: Reservation, policy: Policy, ex: Exchange) -> None:
        """Settle what the deployment reported, or release the hold of a call that generated nothing.

        What was generated is charged, also when the client left or the deployment died mid-stream (the relay
        then counts the streamed tokens); only a call no deployment took is released.
        """
        if ex.usage is not None or ex.side_parts:  # a summary made for the call is charged even if it failed after
            await self._settle(held, policy, ex)
        else:
            await self.budgets.release(held)

    async def hold(
        self, admitted: Admitted, policy: Policy, decision: Decision
    ) -> tuple[Reservation, Decision]:
        """Hold the largest worst case among the deployments failover may try, else the chosen one's alone."""
        widest = _with_resume(admitted, policy, decision,
                              max((admitted.costs[name] for name in decision.attempts), key=lambda c: c.usd))
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
        usage: Usage = ex.usage or Usage(0, 0)
        answered = ex.deployment if ex.deployment in policy.deployments else held.deployment
        price = policy.deployments[answered].price
        # a stream another deployment finished: each earlier part at the price of the one that generated it
        before = [(part_price or price, part) for _, part_price, part in ex.parts or ()]
        # calls made for the answer beside it (a compaction's summary), at the price of the deployment that made them
        before += [(part_price or price, part) for _, part_price, part in ex.side_parts or ()]
        await self.budgets.settle(held, price, usage, deployment=answered, before=before)


def _with_resume(admitted: Admitted, policy: Policy, decision: Decision, widest: Cost) -> Cost:
    """The hold of a stream the next deployment may finish: also that deployment reading the prompt and the
    whole answer so far again as its prompt (at most prompt plus cap), at its input price."""
    siblings = decision.attempts[1:]
    if not admitted.may_resume or not siblings:
        return widest
    tokens = max(admitted.costs[n].tokens for n in siblings)
    # the sibling's cache holds none of this answer, nor (after a switch) the prompt: all of it priced as new
    usd = max(policy.deployments[n].price.cost_usd(admitted.costs[n].tokens, 0, cached_tokens=0) for n in siblings)
    return Cost(widest.usd + usd, widest.tokens + tokens)


async def _prompt_size(policy: Policy, features: Features, body: Mapping[str, Any], body_bytes: int) -> PromptSize:
    """The prompt's bounds; when they need an exact count, counted in a worker thread (tiktoken releases the
    GIL while it encodes), so a long prompt never stalls the event loop."""
    size = prompt_size(features, body_bytes)
    if not room_depends_on_count(policy, features, size):
        return size
    return await asyncio.to_thread(measure_prompt, policy, features, body, body_bytes)
