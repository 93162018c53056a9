"""Warm-ups: after a step's answer is relayed, its prompt prefilled on the deployment the session's next step is
expected on (decision/switch.expected_next), while the agent's tool runs; admitted by decision/warmup.admit.

    warmups.arrived(tenant, session_id)            the session's next step is here: its warm-up is stale, cancelled
    warmups.after(adapter, call, decision, sighting, ex)   start the decision's warm-up, or say on the step why not

One warm-up per session at a time (a newer one supersedes it), at most `max_in_flight` per deployment (one more
is dropped). A warm-up is one call through the pooled client, bounded by `timeout_s`: the prompt with
`max_tokens: 1`, held against the tenant's budgets first (and its session's: a warm-up that does not fit is
skipped, `budget`) and settled at what the deployment reports, charged as the deployment's tokens to the tenant
(gateway_tokens_total, the spend, the session's cost), and once
it is done the session's record holds the prompt's chain on that deployment, so the next step's switch price
sees it cached. Cancelling one drops its connection, and vLLM aborts a request whose client went away.
A step arriving at another gateway replica does not cancel this one's warm-up: it then ends on its own, and
its record write only adds the chain the deployment holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from gateway.accounting.budgets import Budgets
from gateway.accounting.ledger import RESERVE_MARGIN_S
from gateway.apis import json_body
from gateway.apis.adapter import Adapter
from gateway.apis.usage import Usage
from gateway.context.prefix import rescaled
from gateway.decision.admission import Cost
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.decision.warmup import Outcome, admit
from gateway.errors import GatewayError, RateLimited, UpstreamTimeout
from gateway.policy.model import Deployment
from gateway.policy.switch import SwitchPolicy
from gateway.policy.tenancy import TenantPolicy, find_tenant
from gateway.server.session_caches import Sighting, reported_cached_tokens
from gateway.store.contract import StoreError, StoreFault
from gateway.store.prefixes import PrefixStore
from gateway.telemetry import metrics as t
from gateway.telemetry.exchange import Exchange
from gateway.upstream import forward as upstream
from gateway.upstream.client import Pool
from gateway.upstream.deployments import Deployments

log = logging.getLogger(__name__)

WARMUP_HEADER = "x-gateway-warmup"  # on every warm-up call: the deployment's logs can tell them from live calls
LIMIT_BYTES = 1024 * 1024  # a one-token answer is a few hundred bytes
# What a warm-up does not send: its output is one token, never streamed, never stored, never constrained.
NOT_SENT = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "response_format",
            "max_tokens", "max_completion_tokens", "max_output_tokens", "store", "background")


def warm_body(adapter: Adapter, body: dict[str, Any], served_model: str) -> bytes:
    """The call's body as the deployment's API reads it, generating one token: the same prompt, so the deployment
    prefills exactly what the session's next step will find cached."""
    out = {key: value for key, value in body.items() if key not in NOT_SENT}
    out["stream"] = False
    if adapter.endpoint == "responses":
        out["store"] = False  # the gateway keeps the conversation; the deployment keeps nothing
    else:
        out["max_tokens"] = 1  # chat, completions and messages all read it (the cap below leaves it)
    payload, _ = adapter.upstream_body(out, served_model, 1)
    return payload


@dataclass(slots=True)
class _Warmup:
    deployment: str
    task: asyncio.Task[None] | None = None
    stopped: Outcome | None = None  # why it was cancelled, when it was


class Warmups:
    """The process's warm-ups in flight, one per session."""

    def __init__(self, pool: Pool, deployments: Deployments, store: PrefixStore, metrics: t.Metrics,
                 budgets: Budgets) -> None:
        self.pool, self.deployments, self.store, self.metrics = pool, deployments, store, metrics
        self.budgets = budgets
        self._sessions: dict[tuple[str, str], _Warmup] = {}
        self._warming: dict[str, int] = {}  # deployment -> warm-ups in flight

    def warming(self, deployment: str) -> int:
        return self._warming.get(deployment, 0)

    def arrived(self, tenant: str, session_id: str) -> None:
        """The session's next step is here: a warm-up still in flight for it is stale."""
        if self._sessions:
            self._stop((tenant, session_id), Outcome.CANCELLED)

    def after(self, adapter: Adapter, call: Call, decision: Decision, sighting: Sighting | None, ex: Exchange) -> None:
        """Once the step's answer is relayed: the decision's warm-up starts, or the step says why it does not."""
        switch, target = call.policy.switch, decision.warm
        if switch is None or switch.warm is None or target is None or sighting is None:
            return
        dep = call.policy.deployments.get(target)
        if dep is None or ex.usage is None or ex.deployment in (None, target):
            return  # the call failed, or failover already served it there
        uncached = sighting.cache.uncached(target)
        why_not = admit(switch.warm, uncached, self.deployments.load.get(target), self.warming(target))
        self._note(ex, f"{target} {why_not or 'started'}")
        if why_not is not None:
            self.metrics.caches.warmups.labels(target, why_not).inc()
            return
        key = (sighting.tenant, sighting.session_id)
        self._stop(key, Outcome.SUPERSEDED)
        warmup = self._sessions[key] = _Warmup(target)
        self._warming[target] = self.warming(target) + 1
        payload = warm_body(adapter, call.body, dep.served_model)
        headers = {"x-request-id": f"{ex.request_id}-warm", WARMUP_HEADER: "1"}
        # the hold's worst case: the step's prompt, what the target holds of it at the cached price, one token
        cost = Cost(dep.price.cost_usd(ex.usage.prompt_tokens, 1, cached_tokens=ex.usage.prompt_tokens - uncached),
                    ex.usage.prompt_tokens + 1)
        # held as the policy holds its live calls: only where it accounts (budgets, tenants, session caps)
        hold = (find_tenant(call.policy.tenants, sighting.tenant), cost) if call.policy.accounted else None
        warmup.task = asyncio.create_task(
            self._held(warmup, adapter, dep, switch, sighting, payload, headers, hold),
            name=f"warm-up {target}")
        warmup.task.add_done_callback(lambda _: self._ended(key, warmup))

    @staticmethod
    def _note(ex: Exchange, said: str) -> None:
        ex.attributes[t.CACHE_WARMUP] = said
        if ex.step is not None and ex.step.cache is not None:
            ex.step.cache = dataclasses.replace(ex.step.cache, warm_up=said)

    def _stop(self, key: tuple[str, str], why: Outcome) -> None:
        found = self._sessions.pop(key, None)
        if found is not None and found.task is not None and not found.task.done():
            found.stopped = why
            found.task.cancel()

    def _ended(self, key: tuple[str, str], warmup: _Warmup) -> None:
        self._warming[warmup.deployment] -= 1
        if self._sessions.get(key) is warmup:
            del self._sessions[key]

    async def _held(self, warmup: _Warmup, adapter: Adapter, dep: Deployment, switch: SwitchPolicy,
                    sighting: Sighting, payload: bytes, headers: dict[str, str],
                    hold: tuple[TenantPolicy | None, Cost] | None) -> None:
        """The warm-up inside a hold on the tenant's budgets: settled at its usage, released if it made none."""
        if hold is None:
            await self._warm(warmup, adapter, dep, switch, sighting, payload, headers)
            return
        target, (limits, cost) = warmup.deployment, hold
        try:
            async with self.budgets.holding(sighting.tenant, limits, target, cost, dep.price,
                                            session_id=sighting.session_id,
                                            ttl_s=dep.timeouts.total_s + RESERVE_MARGIN_S) as charge:
                charge.usage = await self._warm(warmup, adapter, dep, switch, sighting, payload, headers)
        except RateLimited:
            self._count(target, Outcome.BUDGET)
        except (StoreError, StoreFault) as exc:  # no hold, no warm-up: it is never worth an unaccounted prefill
            log.warning("warm-up of %s: no hold on the budget: %s", target, exc)
            self._count(target, Outcome.FAILED)

    async def _warm(self, warmup: _Warmup, adapter: Adapter, dep: Deployment, switch: SwitchPolicy,
                    sighting: Sighting, payload: bytes, headers: dict[str, str]) -> Usage | None:
        """The warm-up's call and its record; its usage when the deployment answered one."""
        target, warm = warmup.deployment, switch.warm
        assert warm is not None  # after() starts none without it
        usage: Usage | None = None
        try:
            got = await upstream.fetch(self.pool, target, dep, adapter.path, payload, headers,
                                       timeout_s=warm.timeout_s, limit_bytes=LIMIT_BYTES)
            found = json_body.decode(got.body) if got.status == 200 else None
            usage = adapter.usage_of(found) if found is not None else None
            if usage is None:
                log.warning("warm-up of %s answered %d without usage", target, got.status)
                self._count(target, Outcome.FAILED)
                return None
            self._charge(target, dep, sighting, usage)
            await self.store.warmed(sighting.tenant, sighting.session_id, target,
                                    rescaled(sighting.prompt, usage.prompt_tokens), switch.ttl_s)
            self._count(target, Outcome.DONE)
        except asyncio.CancelledError:
            self._count(target, warmup.stopped or Outcome.CANCELLED)
            raise
        except UpstreamTimeout:
            self._count(target, Outcome.TIMEOUT)
        except (GatewayError, ValueError) as exc:
            log.warning("warm-up of %s failed: %s", target, exc)
            self._count(target, Outcome.FAILED)
        except (StoreError, StoreFault) as exc:  # prefilled, but the record does not say so: the next step pays
            log.warning("warm-up of %s: the session's record could not be written: %s", target, exc)
            self._count(target, Outcome.DONE)
        return usage

    def _count(self, deployment: str, outcome: Outcome) -> None:
        self.metrics.caches.warmups.labels(deployment, outcome.value).inc()

    def _charge(self, deployment: str, dep: Deployment, sighting: Sighting, usage: Usage) -> None:
        """The warm-up's tokens, charged to the session's tenant as the deployment's input (its prefill is the
        point; the one output token is charged too; what the deployment already held at the cached price), and
        split into prefilled and already held."""
        reported = reported_cached_tokens(usage)
        held = reported if reported is not None else min(sighting.cache.cached.get(deployment, 0),
                                                          usage.prompt_tokens)
        series = self.metrics.caches.warmup_tokens
        series.labels(deployment, "cached").inc(held)
        series.labels(deployment, "uncached").inc(usage.prompt_tokens - held)
        self.metrics.count_tokens(deployment, sighting.tenant, usage, dep.price.cost_usd_of(usage))

    async def close(self) -> None:
        """Cancel the warm-ups in flight (a gateway that stops has no session to warm for)."""
        tasks = [w.task for w in self._sessions.values() if w.task is not None]
        for warmup in self._sessions.values():
            warmup.stopped = Outcome.CANCELLED
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
