"""The policy's `summarize_old_turns` on the request path: a conversation's oldest turns replaced by a summary that
was written after an earlier step (context/eviction.py decides the span; context/summaries.py is the summarizer
every compaction uses).

    body, evicted = evictions.apply(shape, rule, body, owner)   at read: the newest summary ready for this
                                                                conversation's span, put in (no I/O)
    evictions.after(call, evicted, ex)                          once the step is answered: the span now due is
                                                                summarized in the background for the next step

A summary is written by the policy's compaction deployment, asked as the conversation's next turn, so that the
deployment that served the session prefills only the ask; its tokens are held against and charged to the
tenant's budgets (and its session's), like a warm-up's. The summarized entries go to the object store first: the
summary's first line names them. Until the summary for the span now due is ready, the step is sent with the
newest one that is (or whole): the summary never waits on the hot path. Each process keeps its own summaries
(bounded); a replica that has none for a span writes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.accounting.budgets import Budgets, Charge
from gateway.accounting.ledger import RESERVE_MARGIN_S
from gateway.apis.adapter import Adapter
from gateway.context.counting import text_tokens
from gateway.context.eviction import (
    EvictRule,
    Turns,
    TurnShape,
    boundary,
    read_turns,
    span_document,
    summarized,
    summary_text,
)
from gateway.context.masking import reference
from gateway.context.retrieval import pieces_of_span
from gateway.context.summaries import continuation_prompt
from gateway.decision.admission import Cost
from gateway.decision.call import Call
from gateway.errors import GatewayError, RateLimited
from gateway.features import estimate_tokens
from gateway.policy.tenancy import find_tenant
from gateway.server import summarizer
from gateway.server.retrieval import Library
from gateway.store.contract import StoreError, StoreFault
from gateway.store.objects import ObjectStore
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import Metrics
from gateway.upstream.client import Pool

log = logging.getLogger(__name__)

READY_MAX = 1_024  # summaries kept (each a few KB): the newest per conversation is the one in use
IN_FLIGHT_MAX = 4  # summaries being written at once; one more is skipped (`busy`) and asked again at a later step
RETRY_AFTER_S = 60.0  # a span whose summary failed is not asked again sooner


@dataclass(frozen=True, slots=True)
class Ready:
    text: str  # the summary's entry text, its first line naming the originals
    tokens: int
    ref: str  # the summarized entries' reference in the object store


@dataclass(frozen=True, slots=True)
class Evicted:
    """What summarizing old turns did to one prompt, and what it leaves to do after the step."""

    used: int  # entries head..used of the conversation are in the summary sent (used == head: none)
    due: int  # where the rule puts the span now
    entries: int  # entries the summary sent stands for
    tokens_saved: int  # their tokens less the summary's
    pending: Pending | None  # the summary of the span now due, to write after the step
    ref: str | None  # the summarized entries of the summary sent (retrieval's candidates), if one was


@dataclass(frozen=True, slots=True)
class Pending:
    key: str
    end: int  # the span now due ends before this entry of the body as sent (with the summary sent, if any)
    summary_tokens: int  # the rule's bound on the summary
    embeddings: bool | None  # retrieval indexes the span's entries (with embeddings or not); None: no retrieval
    document: bytes  # the span's original entries (the object store's copy)
    entries: int
    tokens: int


EVICTED = web.RequestKey("evicted", Evicted)  # the request's, from read to after the answer


class Evictions:
    """The process's summaries of old turns: ready ones by span, and those being written."""

    def __init__(self, pool: Pool, limit_bytes: int, objects: ObjectStore, library: Library, metrics: Metrics,
                 budgets: Budgets, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.limit_bytes, self.objects, self.library = pool, limit_bytes, objects, library
        self.metrics, self.budgets, self._clock = metrics, budgets, clock
        self._ready: OrderedDict[tuple[str, str], Ready] = OrderedDict()
        self._writing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed: dict[tuple[str, str], float] = {}

    def apply(self, shape: TurnShape, rule: EvictRule, body: dict[str, Any], owner: str,
              embeddings: bool | None = None) -> tuple[dict[str, Any], Evicted | None]:
        """The body with the newest ready summary of its old turns in place (or as it was), and what was done."""
        turns = read_turns(shape, body)
        if turns is None:
            return body, None
        due = boundary(turns, rule)
        if due == turns.head:
            return body, None
        used, ready = self._newest_ready(owner, turns, due)
        sent = body if ready is None else summarized(shape, body, turns.head, used, ready.text)
        saved = 0 if ready is None else turns.span_tokens(used) - ready.tokens
        pending = None if used == due else self._pending(owner, turns, used, due, rule, embeddings)
        return sent, Evicted(used, due, used - turns.head, saved, pending, None if ready is None else ready.ref)

    def _newest_ready(self, owner: str, turns: Turns, due: int) -> tuple[int, Ready | None]:
        for cut in range(due, turns.head, -1):
            if turns.starts[cut]:
                found = self._ready.get((owner, turns.span_key(cut)))
                if found is not None:
                    self._ready.move_to_end((owner, turns.span_key(cut)))
                    return cut, found
        return turns.head, None

    def _pending(self, owner: str, turns: Turns, used: int, due: int, rule: EvictRule,
                 embeddings: bool | None) -> Pending | None:
        key = turns.span_key(due)
        if (owner, key) in self._writing or self._failed.get((owner, key), -1e18) + RETRY_AFTER_S > self._clock():
            return None
        end = due if used == turns.head else turns.head + 1 + (due - used)  # the same span in the body as sent
        return Pending(key, end, rule.summary_tokens, embeddings, span_document(turns, due), due - turns.head,
                       turns.span_tokens(due))

    def after(self, adapter: Adapter, call: Call, evicted: Evicted | None, ex: Exchange) -> None:
        """Once the step is answered: the span now due is summarized in the background (or skipped, `busy`)."""
        if evicted is None or evicted.pending is None or ex.usage is None or adapter.turns is None:
            return
        pending, owner = evicted.pending, call.tenant_or_anonymous
        if len(self._writing) >= IN_FLIGHT_MAX:
            self._count("busy")
            return
        key = (owner, pending.key)
        if key in self._writing:  # a step a moment earlier asked for the same span
            return
        # what the summarizer continues: the body as sent (masked too), cut after the span now due
        entries = call.body[adapter.turns.key]
        body = {**call.body, adapter.turns.key: entries[:pending.end]}
        task = asyncio.create_task(self._write(adapter, call, body, pending, owner, ex.request_id),
                                   name="summary of old turns")
        self._writing[key] = task
        task.add_done_callback(lambda _: self._writing.pop(key, None))

    async def _write(self, adapter: Adapter, call: Call, body: dict[str, Any], pending: Pending, owner: str,
                     request_id: str) -> None:
        policy, key = call.policy, (owner, pending.key)
        name = policy.compaction.summarizer(policy.deployments, policy.default)
        dep = policy.deployments[name]
        prompt = continuation_prompt(adapter.view(body)["messages"])
        max_tokens = pending.summary_tokens
        before = text_tokens(pending.document.decode("utf-8", "surrogatepass"))
        cost = Cost(dep.price.cost_usd(before, max_tokens, cached_tokens=0), before + max_tokens)
        hold: contextlib.AbstractAsyncContextManager[Charge] = (
            self.budgets.holding(owner, find_tenant(policy.tenants, owner), name, cost, dep.price,
                                 session_id=call.session_id, ttl_s=policy.compaction.timeout_s + RESERVE_MARGIN_S)
            if policy.accounted else contextlib.nullcontext(Charge()))
        try:
            ref = reference(pending.document)
            await self.objects.put(owner, ref, pending.document)
            async with hold as charge:  # a cancel releases the hold and goes on up (the gateway stopping)
                written = await summarizer.write(self.pool, self.limit_bytes, policy, name, prompt,
                                                 f"{request_id}-summary", max_tokens, pending.tokens)
                charge.usage = written.usage
        except RateLimited:
            self._failed_now(key, "budget")
            return
        except (GatewayError, StoreError, StoreFault, ValueError) as exc:
            log.warning("summary of old turns (%d entries) failed: %s", pending.entries, exc)
            self._failed_now(key, "failed")
            return
        self.metrics.count_tokens(name, owner, written.usage, dep.price.cost_usd_of(written.usage))
        text = summary_text(written.text, pending.entries, pending.tokens, ref)
        self._keep(key, Ready(text, estimate_tokens(text), ref))  # counted as the span's entries are
        if pending.embeddings is not None:  # the entries are retrieval's pieces from now on
            self.library.index(owner, ref, pieces_of_span(pending.document), pending.embeddings)
        self._count("written")

    def _keep(self, key: tuple[str, str], ready: Ready) -> None:
        self._ready[key] = ready
        while len(self._ready) > READY_MAX:
            self._ready.popitem(last=False)

    def _failed_now(self, key: tuple[str, str], outcome: str) -> None:
        self._failed[key] = self._clock()
        if len(self._failed) > READY_MAX:
            self._failed.pop(next(iter(self._failed)))
        self._count(outcome)

    def _count(self, outcome: str) -> None:
        self.metrics.context_summaries.labels(outcome).inc()

    def ready_for(self, owner: str) -> Mapping[tuple[str, str], Ready]:
        """The summaries kept for `owner` (tests and the admin read them)."""
        return {key: ready for key, ready in self._ready.items() if key[0] == owner}

    async def close(self) -> None:
        """Cancel the summaries being written (a gateway that stops has no next step to put them in)."""
        tasks = list(self._writing.values())
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
