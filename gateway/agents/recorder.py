"""Agent trajectories at run time: the request path's step hook and session verdict, and the flusher that
digests, judges and stores the queued steps in batches, off the request path.

The request path only reads the session's active flags (when the tenant's rules act beyond flagging),
hangs a `PendingStep` on the exchange (the relay keeps the response's tool-call bytes on it) and, when the
exchange ends, queues it. Every FLUSH_S the flusher parses the tool calls, reads the batch's sessions from
the store in one round trip, raises loop and spike flags, writes the steps back in one transaction,
updates the process metrics and the rollout cohorts, and records each step's span (deferred until then,
so it can carry the step's tool calls and flag events) with `execute_tool` children for the tool outputs
the step sent back.

Bounded: a queued step keeps digests and at most MAX_KEPT_BYTES of tool-call bytes (KEPT_BYTES_MAX for the
whole queue), a flush takes at most BATCH_MAX steps and yields to the event loop every SLICE_S of work, and
a step that cannot be read or judged is dropped alone (counted as `bad_step`), never its batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.agents import loops as found
from gateway.agents import spikes
from gateway.agents import trajectory as tr
from gateway.agents.loops import AgentVerdict, Finding
from gateway.agents.outcome_reports import CohortCounts, Outcomes
from gateway.agents.outcomes import Membership, Outcome, read_header
from gateway.agents.pending_steps import Cohorted, PendingStep, StepReport
from gateway.agents.session_ids import shown_id, stored_ids
from gateway.agents.trajectory import Step
from gateway.apis.usage import Usage
from gateway.decision.call import Call
from gateway.errors import NotFound
from gateway.policy.agents import SpikePolicy
from gateway.policy.model import Policy
from gateway.store.contract import StoreError
from gateway.store.trajectories import Active, Append, Ref, SessionRecord, SpendSeries, TrajectoryStore
from gateway.telemetry import metrics as t
from gateway.telemetry.exchange import Exchange

log = logging.getLogger(__name__)

FLUSH_S = 0.1
QUEUE_MAX = 20_000  # steps waiting for the flusher; beyond this they are dropped (and counted)
KEPT_BYTES_MAX = 32 * 1024 * 1024  # tool-call bytes the queue keeps for the flusher; beyond, read when queued
BATCH_MAX = 2_000  # steps one flush takes; the rest wait for the next, which follows at once
RECENT_STEPS = 50  # a session's steps the flusher reads to judge a new one (loop windows, rework)
SLICE_S = 0.0002  # the flusher's work between two yields to the event loop: about what a request may wait for it


@dataclass(slots=True)
class _Batch:
    """One flush's view of its sessions and tenants, updated step by step as the batch is judged."""

    records: dict[Ref, SessionRecord]
    tenants: dict[str, SpendSeries]
    appends: list[Append] = field(default_factory=list)


class Trajectories:
    """The process's trajectory recorder: request-path hooks plus the background flusher."""

    def __init__(self, store: TrajectoryStore, current: Callable[[], Policy], metrics: t.Metrics,
                 record_process: Callable[..., None] | None = None, *,
                 keep_text: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.store, self._current, self.keep_text, self.clock = store, current, keep_text, clock
        self.report = StepReport(metrics, record_process)
        # one batch at a time: two in flight would both read a session before either wrote its new steps
        self._flushing = asyncio.Lock()
        # reports from the outcome API and from step headers
        self.outcomes = Outcomes(store, metrics, clock)
        self._queue: list[PendingStep] = []
        self._kept_bytes = 0  # tool-call bytes the queued steps keep
        self._task: asyncio.Task[None] | None = None
        self._window_spend: dict[str, tuple[int, dict[str, float]]] = {}  # tenant -> (window, session -> USD)
        self._spikes_logged: dict[tuple[str, int], None] = {}

    # --- the request path ---

    @staticmethod
    def recording(call: Call) -> bool:
        """Whether this call is an agent step the policy records."""
        return call.policy.agents.record.enabled and tr.is_step(call.features, call.headers)

    async def verdict(self, policy: Policy, tenant: str, session_id: str, ex: Exchange) -> AgentVerdict | None:
        """What the session's active flags ask of this request; reads the store only when the tenant's
        rules act beyond flagging. A store that does not answer means no action (fail open)."""
        loop_rules, spike_rules = policy.agents.for_tenant(tenant)
        if loop_rules.action == "flag" and spike_rules.action == "flag":
            return None
        try:
            active = await self.store.active((tenant, session_id))
        except StoreError as exc:
            log.debug("trajectory store: %s", exc)
            return None
        verdict = found.verdict(active, loop_rules, spike_rules, self.clock()) if active else None
        if verdict is not None:
            self.report.child("actions", tenant, verdict.flag, verdict.action).inc()
            ex.attributes[t.AGENT_ACTION] = f"{verdict.action} ({verdict.flag})"
        return verdict

    def begin(self, ex: Exchange, call: Call, cohorted: Cohorted | None) -> None:
        """Hang the step of an admitted call on the exchange; it queues itself when the exchange ends. Its
        `x-session-outcome` header (success|failure; any other value is a 400) sets the session's outcome
        once the step is recorded."""
        session_id = call.session_id
        assert session_id is not None
        outcome = read_header(call.headers)
        ex.attributes[t.GEN_AI_CONVERSATION_ID] = shown_id(session_id)  # the conversation as its client names it
        ex.step = step = PendingStep(self.queue, self.clock(), call.policy, call.tenant_or_anonymous, session_id,
                                     call.view.get("messages"), call.features.tools_count > 0, cohorted,
                                     call.step.verdicts if call.step is not None else ())
        step.outcome = outcome

    def queue(self, step: PendingStep) -> None:
        if 400 <= step.status < 499:  # the deployment refused the call (bad request, too long): no step happened
            self.report.plain_span(step)
            return
        if len(self._queue) >= QUEUE_MAX:
            self.report.child("dropped", "queue_full").inc()
            self.report.plain_span(step)
            return
        step.distill(self.keep_text, KEPT_BYTES_MAX - self._kept_bytes)
        self._kept_bytes += step.kept_bytes
        self._queue.append(step)

    # --- a session by the id users know it by ---

    async def locate(self, given: str, tenant: str | None, *, settled: bool = False) -> Ref:
        """The recorded session a user's id names (sessions.stored_ids), in `tenant` or in any tenant; NotFound
        naming the id when none is, or when several are (two tenants', or a client's and the gateway's).

        `settled` (an outcome report, which an agent sends right after its last step): this process's queued
        steps are written first, and a session not found yet is looked for again after another replica's
        flusher has had its turn."""
        if settled:
            await self.flush()
        refs = await self.store.find(stored_ids(given), tenant)
        if not refs and settled:
            await asyncio.sleep(FLUSH_S * 2)
            refs = await self.store.find(stored_ids(given), tenant)
        if len(refs) == 1:
            return refs[0]
        of = f" of tenant {tenant!r}" if tenant is not None else ""
        if not refs:
            raise NotFound(f"No recorded agent session {given!r}{of}{_hint(given)} (sessions idle longer than the "
                           "policy's agents.record.ttl_s, or beyond max_sessions, are forgotten)",
                           param="session_id", code="session_not_found")
        tenants = sorted({t for t, _ in refs})
        if len(tenants) > 1:
            raise NotFound(f"Agent session {given!r} is recorded for tenants {', '.join(map(repr, tenants))}: name "
                           "the tenant (?tenant=, or --tenant)", param="session_id", code="session_ambiguous")
        raise NotFound(f"Agent session {given!r}{of} names two recorded sessions: the one its client named so and "
                       "the one the gateway named so", param="session_id", code="session_ambiguous")

    # --- the flusher ---

    def count_outcomes_in(self, counters: CohortCounts) -> None:
        """Outcomes of sessions measured in a rollout cohort count toward its guards from now on."""
        self.outcomes.counters = counters

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="trajectory-flush")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(StoreError):
            while self._queue:
                await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S if len(self._queue) <= BATCH_MAX else 0)
            try:
                await self.flush()
            except Exception:  # a fault of the store or of a report must not end the recorder
                log.exception("trajectory flush failed")

    async def flush(self) -> None:
        """Digest, judge and write up to BATCH_MAX queued steps, the oldest (after any batch in flight: the outcome
        API calls it too)."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        pending, self._queue = self._queue[:BATCH_MAX], self._queue[BATCH_MAX:]
        self._kept_bytes -= sum(p.kept_bytes for p in pending)
        slices = _Slices()
        read: list[tuple[PendingStep, Step]] = []
        for p in pending:
            step = self._read(p)
            if step is not None:
                read.append((p, step))
            await slices.next()
        if not read:
            return
        pending = [p for p, _ in read]
        refs = list(dict.fromkeys((p.tenant, p.session_id) for p in pending))
        try:
            batch = _Batch(await self.store.read(refs, RECENT_STEPS),
                           await self.store.tenant_spend(list(dict.fromkeys(p.tenant for p in pending))))
        except StoreError as exc:
            log.warning("trajectory store unreachable: %d steps not recorded (%s)", len(pending), exc)
            self.report.child("dropped", "store_unavailable").inc(len(pending))
            for p in pending:
                self.report.plain_span(p)
            return
        for p, step in read:
            self._judge_alone(batch, p, step)
            await slices.next()
        self.report.apply()
        policy = self._current()
        try:
            await self.store.append(batch.appends, _old_tenant_buckets(batch, policy), policy.agents.record)
        except StoreError:
            self.report.child("dropped", "store_unavailable").inc(len(pending))
            return
        await self._report_outcomes(pending)

    async def _report_outcomes(self, pending: Sequence[PendingStep]) -> None:
        """The outcomes steps' headers report, once their steps are in the record (their spend counted)."""
        for p in pending:
            if p.outcome is None:
                continue
            try:
                await self.outcomes.report((p.tenant, p.session_id), Outcome(p.outcome, source="header"))
            except StoreError as exc:
                log.warning("outcome of session %r not recorded: %s", shown_id(p.session_id), exc)

    def _read(self, p: PendingStep) -> Step | None:
        """The step as data, or None (counted) when it cannot be read: one malformed step costs only itself."""
        try:
            return self._digest(p)
        except Exception as exc:
            self._drop_bad(p, "read", exc)
            return None

    def _judge_alone(self, batch: _Batch, p: PendingStep, step: Step) -> None:
        appended = len(batch.appends)
        try:
            self._judge(batch, p, step)
        except Exception as exc:
            if len(batch.appends) == appended:  # judged too far to be appended: recorded, not dropped
                self._drop_bad(p, "judge", exc)

    def _drop_bad(self, p: PendingStep, stage: str, exc: Exception) -> None:
        log.warning("agent step of session %r (tenant %r) not recorded: cannot %s it: %s: %.200s",
                    shown_id(p.session_id), p.tenant, stage, type(exc).__name__, exc)
        self.report.child("dropped", "bad_step").inc()
        with contextlib.suppress(Exception):
            self.report.plain_span(p)

    def _digest(self, p: PendingStep) -> Step:
        """The step as data: the response's tool calls, the digests of what the request sent back."""
        ex = p.ex
        assert ex is not None
        usage = ex.usage or Usage()
        deployment = ex.deployment or "none"
        dep = p.policy.deployments.get(deployment)
        arm = p.cohorted.cohort.value if p.cohorted is not None else None
        sent = p.sent
        cost_usd, compaction_usd = ex.cost_usd() if dep is not None else (0.0, 0.0)
        return Step(p.at, deployment, ex.rule or "", arm, usage.prompt_tokens, usage.completion_tokens,
                    cost_usd, p.elapsed_s * 1000,
                    None if p.ttft_s is None else p.ttft_s * 1000, p.status, p.tool_calls(self.keep_text),
                    sent.tool_results, sent.echo, prompt=sent.prompt, cache=p.cache,
                    tokens_cached=usage.cached_tokens,
                    compaction=ex.compaction[0] if ex.compaction is not None else None,
                    compaction_cost_usd=compaction_usd, masked=ex.masked,
                    summarized=ex.summarized, retrieved=ex.retrieved)

    def _judge(self, batch: _Batch, p: PendingStep, step: Step) -> None:
        """Flag the step against its session's recent steps and spend; queue its append; count and trace it."""
        ref = (p.tenant, p.session_id)
        rec = batch.records.setdefault(ref, SessionRecord())
        loop_rules, spike_rules = p.policy.agents.for_tenant(p.tenant)
        first = rec.steps_total == 0
        total = rec.steps_total + 1
        step.step = total
        step.rework = found.rework(rec.steps, step)
        findings = found.loops(rec.steps, step, loop_rules, total)
        findings += self._spikes(batch, rec, p, step, spike_rules)
        step.flags = tuple(f.flag for f in findings)
        active, cleared, raised = _flags(rec.active, findings, step.at, spike_rules, p.policy)
        rate = tr.steps_per_min(rec.steps, step.at)
        old = _old_buckets(rec.spend.buckets, step.at, spike_rules)
        batch.appends.append(Append(p.tenant, p.session_id, step, rate, active, cleared, raised, old,
                                    _route(p), _membership(p)))
        previous_at = rec.last_at if rec.steps_total else step.at
        _advance(rec, p, step, active, cleared)
        self.report.count(p, step, first, max(0.0, step.at - previous_at))
        events = self.report.flagged(p, step, findings, raised, loop_rules, spike_rules)
        self.report.record_span(p, step, rec.steps, events)

    def _spikes(self, batch: _Batch, rec: SessionRecord, p: PendingStep, step: Step,
                rules: SpikePolicy) -> list[Finding]:
        if not step.cost_usd:
            return []
        index = spikes.bucket(step.at)
        rec.spend.buckets[index] = rec.spend.buckets.get(index, 0.0) + step.cost_usd
        out = []
        if "session" in rules.scopes:
            since = rec.started_at if rec.steps_total else step.at
            spike = spikes.spike(rec.spend.buckets, since, step.at, rules)
            if spike is not None:
                out.append(Finding(found.SPIKE_SESSION, spike.describe("the session")))
        tenant = batch.tenants.setdefault(p.tenant, SpendSeries(step.at))
        tenant.since = tenant.since or step.at
        tenant.buckets[index] = tenant.buckets.get(index, 0.0) + step.cost_usd
        if "tenant" in rules.scopes:
            window = self._note_window_spend(p, step, rules)
            spike = spikes.spike(tenant.buckets, tenant.since, step.at, rules)
            if spike is not None and self._drives(p, spike, window):
                out.append(Finding(found.SPIKE_TENANT, spike.describe(f"tenant {p.tenant!r}")))
        return out

    def _drives(self, p: PendingStep, spike: spikes.Spike, window: int) -> bool:
        """Whether this step's session spent the most of its tenant's current window (of the sessions this
        process served in it): the session a tenant's spike is pinned on. Logged once per tenant and window."""
        spent = self._window_spend[p.tenant][1]
        driver = max(spent, key=lambda sid: spent[sid])
        if (p.tenant, window) not in self._spikes_logged:
            self._spikes_logged[(p.tenant, window)] = None
            while len(self._spikes_logged) > 1024:
                del self._spikes_logged[next(iter(self._spikes_logged))]
            log.warning("cost spike: %s; driven by session %r (%.4g USD in this window)",
                        spike.describe(f"tenant {p.tenant!r}"), driver, spent[driver])
        return driver == p.session_id

    def _note_window_spend(self, p: PendingStep, step: Step, rules: SpikePolicy) -> int:
        """Add the step to its tenant's per-session spend of the current window; returns the window's index."""
        window = spikes.bucket(step.at) // max(1, round(rules.window_s / spikes.BUCKET_S))
        seen = self._window_spend.get(p.tenant)
        if seen is None or seen[0] != window:
            seen = self._window_spend[p.tenant] = (window, {})
            if len(self._window_spend) > 4096:
                self._window_spend.clear()
                self._window_spend[p.tenant] = seen
        seen[1][p.session_id] = seen[1].get(p.session_id, 0.0) + step.cost_usd
        return window


class _Slices:
    """Cuts the flusher's work into slices of SLICE_S with a yield to the event loop between: a batch of big
    steps is milliseconds of work, and requests must run in between."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def next(self) -> None:
        if time.perf_counter() - self._since >= SLICE_S:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


def _flags(
    active: Active, findings: Sequence[Finding], now: float, spike: SpikePolicy, policy: Policy
) -> tuple[Active, tuple[str, ...], tuple[str, ...]]:
    """The session's active flags after a step: what it found stays active (a stopped loop for the session's
    lifetime, a spike for one window); what it no longer shows lapses. Returns (active, cleared, raised)."""
    now_active: Active = {}
    for f in findings:
        lasts_s = policy.agents.record.ttl_s if f.flag.startswith("loop:") else spike.window_s
        now_active[f.flag] = (now + lasts_s, f.detail)
    cleared = tuple(flag for flag in active if flag not in now_active)
    raised = tuple(flag for flag in now_active if active.get(flag, (0.0, ""))[0] <= now)
    return now_active, cleared, raised


def _advance(rec: SessionRecord, p: PendingStep, step: Step, active: Active, cleared: tuple[str, ...]) -> None:
    """The batch's view of the session after the step, for the batch's next step of the same session."""
    if not rec.steps_total:
        rec.started_at = step.at
    rec.steps_total += 1
    rec.last_at = step.at
    rec.steps.append(step)
    del rec.steps[:-RECENT_STEPS]
    for flag in cleared:
        rec.active.pop(flag, None)
    rec.active.update(active)


def _route(p: PendingStep) -> str:
    if p.cohorted is not None:
        return p.cohorted.route
    model = p.ex.attributes.get(t.GEN_AI_REQUEST_MODEL) if p.ex is not None else None
    return model[:128] if isinstance(model, str) else ""


def _membership(p: PendingStep) -> str:
    c = p.cohorted
    if c is None:
        return ""
    return Membership(c.state.rollout_id, c.state.run, c.state.window, c.cohort.value).encode()


def _old_buckets(buckets: dict[int, float], now: float, rules: SpikePolicy) -> tuple[int, ...]:
    """Spend buckets older than any window the spike check reads (cheap: there are few until there are many)."""
    keep = _history_buckets(rules)
    if len(buckets) <= keep:
        return ()
    cutoff = spikes.bucket(now) - keep
    return tuple(b for b in buckets if b < cutoff)


def _history_buckets(rules: SpikePolicy) -> int:
    return (rules.history_windows + 2) * max(1, round(rules.window_s / spikes.BUCKET_S))


def _old_tenant_buckets(batch: _Batch, policy: Policy) -> dict[str, list[int]]:
    out = {}
    for tenant, series in batch.tenants.items():
        _, rules = policy.agents.for_tenant(tenant)
        if series.buckets:
            newest = max(series.buckets)
            out[tenant] = [b for b in series.buckets if b < newest - _history_buckets(rules)]
    return out


def _hint(given: str) -> str:
    """For an id in the stored form (`h:run-1`), that sessions go by their client's id (`run-1`)."""
    client_id = shown_id(given)
    return f"; sessions go by the id their client sent, here {client_id!r}" if client_id != given else ""
