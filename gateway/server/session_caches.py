"""Each agent session's prefix caches on the request path: read before the decision, noted once a step is served.

    sighting = await caches.sighting(call)      the prompt's chain and what each deployment holds of it
    ... decide(..., Surroundings(cache=sighting.cache)) ...
    caches.served(call, sighting, ex)           the serving deployment now holds this prompt: written in the
                                                background; predicted against reported cached tokens, counted

A store that does not answer means no record (every deployment cold, so no step is held back by a price it
cannot know); a write that fails is logged and dropped: the next step's prediction is then short, never wrong
the other way for long.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from gateway.agents.trajectory import StepCache
from gateway.apis.usage import Usage
from gateway.context.prefix import NO_PREFIXES, Chain, rescaled
from gateway.decision.call import Call
from gateway.decision.switch import SessionCache, session_cache
from gateway.store.contract import StoreError, StoreFault
from gateway.store.prefixes import PrefixStore, Served
from gateway.telemetry import metrics as t
from gateway.telemetry.exchange import Exchange

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # vLLM caches whole blocks: a prediction this close to the report is right
MAX_WAITING = 1_000  # served steps waiting to be written; beyond, a step's record is dropped (and logged)


@dataclass(frozen=True, slots=True)
class Sighting:
    """One step's view of its session's caches: its prompt's chain and the prediction the decision read."""

    tenant: str
    session_id: str
    prompt: Chain
    cache: SessionCache


def reported_cached_tokens(usage: Usage) -> int | None:
    """The prompt tokens the deployment reported it served from its prefix cache (`cached_tokens`, clamped to
    the prompt), or None when its usage carried no such figure (vLLM without --enable-prompt-tokens-details,
    or a garbled one): the prediction is then not checked."""
    return usage.cached_tokens if usage.cached_reported else None


class SessionCaches:
    """The process's reads and writes of the sessions' prefix-cache records."""

    def __init__(self, store: PrefixStore, metrics: t.Metrics) -> None:
        self.store = store
        # Written in batches by one task at a time: a task and a store call per step cost more than the write;
        # the steps' counts go to Prometheus with their batch.
        self._counts = t.BatchedCounts(metrics.caches)
        self._waiting: list[Served] = []
        self._writing: asyncio.Task[None] | None = None

    async def sighting(self, call: Call) -> Sighting | None:
        """The step's sighting when the policy prices switches and the call belongs to a session."""
        switch, session_id = call.policy.switch, call.session_id
        if switch is None or session_id is None:
            return None
        prompt = call.prompt
        tenant = call.tenant_or_anonymous
        try:
            record = await self.store.prefixes(tenant, session_id)
        except (StoreError, StoreFault) as exc:
            log.warning("session caches: the record of a session could not be read: %s", exc)
            record = NO_PREFIXES
        return Sighting(tenant, session_id, prompt, session_cache(record, prompt))

    def served(self, call: Call, sighting: Sighting, ex: Exchange) -> None:
        """The step was answered by `ex.deployment`: count what it held and prefilled, check the prediction,
        and record that it now holds this prompt (in the background: the answer does not wait for the store)."""
        switch, deployment, usage = call.policy.switch, ex.deployment, ex.usage
        if switch is None or deployment is None or usage is None or usage.estimated:
            return
        cache = sighting.cache
        predicted = min(cache.cached.get(deployment, 0), usage.prompt_tokens)
        self._count(cache, deployment, predicted, usage, ex)
        if ex.step is not None:
            ex.step.cache = StepCache(
                cache.prompt_tokens, {name: cache.cached.get(name, 0) for name in call.policy.deployments},
                reported_cached_tokens(usage), cache.home if cache.home not in (None, deployment) else None,
                tuple(sorted(cache.warmed)))
        if len(self._waiting) < MAX_WAITING:
            chain = rescaled(sighting.prompt, usage.prompt_tokens)
            self._waiting.append(Served(sighting.tenant, sighting.session_id, deployment, chain, switch.ttl_s))
        else:
            log.warning("session caches: %d writes waiting; this step's record is dropped", len(self._waiting))
        if self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write())

    def _count(self, cache: SessionCache, deployment: str, predicted: int, usage: Usage, ex: Exchange) -> None:
        counts = self._counts
        counts.add("predicted", deployment, "cached", by=predicted)
        counts.add("predicted", deployment, "uncached", by=usage.prompt_tokens - predicted)
        if cache.home is not None and cache.home != deployment:
            counts.add("switches", cache.home, deployment)
        ex.attributes[t.CACHE_PREDICTED_TOKENS] = predicted
        ex.attributes[t.CACHE_UNCACHED_TOKENS] = " ".join(
            f"{name}={cache.uncached(name)}" for name in sorted({*cache.cached, deployment}))
        reported = reported_cached_tokens(usage)
        if reported is None:
            return
        ex.attributes[t.CACHE_REPORTED_TOKENS] = reported
        counts.observe("prediction_error", deployment, value=abs(predicted - reported))
        if predicted - reported > BLOCK_TOKENS:
            # The deployment had evicted what the record said it held: the record of it is replaced below by
            # the prompt it has just prefilled, which is what it holds now.
            counts.add("misses", deployment)

    async def _write(self) -> None:
        """Count the served steps and write the waiting ones in order, all that wait at a time, until none wait."""
        try:
            while self._waiting or self._counts.pending:
                self._counts.apply()
                batch, self._waiting = self._waiting, []
                if not batch:
                    continue
                try:
                    await self.store.served_many(batch)
                except (StoreError, StoreFault) as exc:
                    log.warning("session caches: the record of %d served steps could not be written: %s",
                                len(batch), exc)
        finally:
            self._writing = None

    async def close(self) -> None:
        """Let the waiting writes finish (each batch bounded by the store's own timeout)."""
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
