"""Budget admission on top of the store: hold the worst case, settle the actual spend, release on failure.

Contract for the core (request path, in this order):

    seen = await budgets.observe(tenant, sid, policy.sessions)     # before decide(), ONE round trip:
                                                                   # the tenant's windows + this session step
    costs = {name: worst_case(dep, prompt_tokens, max_tokens) for name, dep in policy.deployments.items()}
    verdict = tenancy.admission(seen.snapshot, tenant_policy, costs,
                                session=seen.session, sessions=policy.sessions, max_cost_usd=header_cap)
    held = await budgets.reserve(tenant, tenant_policy, chosen, costs[chosen], session_id=sid,
                                 ttl_s=dep.timeouts.total_s + 60)
        # raises errors.RateLimited (429, Retry-After, names the limit) or errors.StoreUnavailable (503)
    try: ... forward ...
    (failover: reserve once with the largest worst case of decision.attempts; settle names the
     deployment that answered)
    then exactly one of:
      await budgets.settle(held, dep.price, usage)  # on completion (usage from upstream, cached tokens priced apart)
      await budgets.release(held)                                   # on failure, cancel, disconnect
    usage_report(store, tenant) -> JSON-able dict for the admin endpoint
settle and release never raise (a store failure is logged and the hold expires after its TTL); a
second settle/release of the same reservation is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.apis.usage import Usage
from gateway.decision.admission import Cost, TenantSnapshot
from gateway.errors import RateLimited
from gateway.policy.model import Price
from gateway.policy.tenancy import SessionPolicy, TenantPolicy
from gateway.store.contract import Hold, Limits, Observation, Refusal, Reservation, Spend, Store, StoreError

log = logging.getLogger(__name__)

RATE_LIMITS = frozenset({"requests_per_minute", "concurrent"})


@dataclasses.dataclass(slots=True)
class Charge:
    """What work done inside a hold (Budgets.holding) made: the deployment's usage, once it answered."""

    usage: Usage | None = None


class Budgets:
    def __init__(self, store: Store, *, reservation_ttl_s: float = 900.0, session_ttl_s: int = 3600) -> None:
        self._store = store
        self._ttl_s = reservation_ttl_s
        self._session_ttl_s = session_ttl_s
        self._open: set[str] = set()

    async def observe(self, tenant: str, session_id: str | None, sessions: SessionPolicy) -> Observation:
        """The tenant's windows and open reservations, and (when `session_id`) this step of the session.

        One atomic store call; raises StoreUnavailable under `on_unavailable: reject`.
        """
        return await self._store.observe(tenant, session_id, sessions.rate_window_s, sessions.idle_ttl_s)

    async def snapshot(self, tenant: str) -> TenantSnapshot:
        """The tenant's current windows and open reservations (raises StoreUnavailable under `reject`)."""
        return await self._store.snapshot(tenant)

    async def reserve(
        self,
        tenant: str,
        policy: TenantPolicy | None,
        deployment: str,
        cost: Cost,
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> Reservation:
        """Hold `cost` against every limit of the tenant at once, or raise RateLimited naming the limit.

        `ttl_s` must outlast the request (the deployment's total timeout plus a margin): a hold that
        expires early frees budget that the still-running request will spend.
        """
        ttl = self._ttl_s if ttl_s is None else ttl_s
        hold = Hold(tenant, deployment, cost, Limits.of(policy), session_id, ttl, self._session_ttl_s)
        result = await self._store.reserve(hold)
        if isinstance(result, Refusal):
            raise _rate_limited(tenant, result)
        self._open.add(result.id)
        return result

    async def settle(
        self,
        reservation: Reservation,
        price: Price,
        usage: Usage,
        *,
        deployment: str | None = None,
        before: Sequence[tuple[Price, Usage]] = (),
    ) -> None:
        """Replace the hold by the actual spend; never raises.

        `deployment` names the one that answered when failover moved the request (usage is per deployment);
        `before`, the earlier parts of a stream it resumed, each with the price of the deployment that made it.
        """
        if reservation.id not in self._open:
            return
        self._open.discard(reservation.id)
        if deployment is not None and deployment != reservation.deployment:
            reservation = dataclasses.replace(reservation, deployment=deployment)
        spend = Spend(0.0, 0, 0)
        for part_price, part in (*before, (price, usage)):
            spend = Spend(spend.usd + part_price.cost_usd_of(part), spend.tokens_in + part.prompt_tokens,
                          spend.tokens_out + part.completion_tokens)
        try:
            await self._store.settle(reservation, spend)
        except Exception as exc:
            log.error("settle of reservation %s failed: %s", reservation.id, exc)

    @contextlib.asynccontextmanager
    async def holding(self, tenant: str, policy: TenantPolicy | None, deployment: str, cost: Cost, price: Price, *,
                      session_id: str | None = None, ttl_s: float | None = None) -> AsyncIterator[Charge]:
        """A hold around work off the request path (a cache warm-up, a summary of old turns): settled at the usage
        the work sets on the charge, released when it sets none (it failed or was cancelled, the gateway
        stopping included), either one shielded from a cancel. Raises as `reserve` does, before the work."""
        held = await self.reserve(tenant, policy, deployment, cost, session_id=session_id, ttl_s=ttl_s)
        charge = Charge()
        try:
            yield charge
        finally:
            if charge.usage is not None:
                await asyncio.shield(self.settle(held, price, charge.usage, deployment=deployment))
            else:
                await asyncio.shield(self.release(held))

    async def release(self, reservation: Reservation) -> None:
        """Drop the hold without spend (failure, cancel, disconnect); never raises."""
        if reservation.id not in self._open:
            return
        self._open.discard(reservation.id)
        try:
            await self._store.release(reservation)
        except Exception as exc:
            log.warning("release of reservation %s failed (it expires on its own): %s", reservation.id, exc)


def _rate_limited(tenant: str, refusal: Refusal) -> RateLimited:
    code = "rate_limit_exceeded" if refusal.limit in RATE_LIMITS else "budget_exceeded"
    return RateLimited(
        f"Tenant {tenant!r} reached its {refusal.limit} limit; retry after {refusal.retry_after_s:.0f} s",
        retry_after_s=refusal.retry_after_s,
        code=code,
    )


async def usage_report(store: Store, tenant: str | None = None) -> dict[str, Any]:
    """Spend, tokens and requests per tenant, deployment and window (current buckets), for the admin API."""
    rows = await store.usage(tenant)
    return {"object": "usage", "data": [row.as_dict() for row in rows]}


__all__ = ["Budgets", "StoreError", "usage_report"]
