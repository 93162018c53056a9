"""An agent step at run time: the request path's pending step, and what a judged step reports (process
metrics per deployment and arm, its rollout cohort's process counters, flag logs and events, its spans)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind

from gateway.agents import trajectory as tr
from gateway.agents.loops import Finding
from gateway.agents.session_ids import shown_id
from gateway.agents.tool_outcomes import Verdict
from gateway.agents.trajectory import Step
from gateway.policy.agents import LoopPolicy, SpikePolicy
from gateway.policy.model import Policy
from gateway.rollout.samples import Cohort, ProcessSample
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.telemetry import metrics as t
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.spans import SpanEvent, Spans

log = logging.getLogger("gateway.agents.recorder")


@dataclass(frozen=True, slots=True)
class Cohorted:
    """The rollout cohort a step was served in, for its process counters."""

    route: str
    spec: RolloutSpec
    state: RolloutState
    cohort: Cohort


MAX_KEPT_BYTES = 256 * 1024  # a queued step's tool-call bytes kept for the flusher; a longer answer is read at once


class PendingStep:
    """A step in the making: what the request path knows, the response's tool-call bytes, the outcome.

    Until it is queued it holds the request's messages and the response's tool-call bytes; `distill` (when
    it is queued) leaves only what the record needs, so a queued step costs a bounded amount of memory.
    """

    __slots__ = ("at", "cache", "calls", "chunks", "cohorted", "elapsed_s", "end_ns", "ex", "judged", "kept_bytes",
                 "messages", "outcome", "policy", "queue", "raw", "sent", "session_id", "spans", "status", "tenant",
                 "ttft_s")

    def __init__(self, queue: Callable[[PendingStep], None], at: float, policy: Policy, tenant: str,
                 session_id: str, messages: Any, tools: bool, cohorted: Cohorted | None,
                 judged: tuple[Verdict, ...] = ()) -> None:
        self.queue, self.at, self.policy, self.tenant, self.session_id = queue, at, policy, tenant, session_id
        self.messages, self.cohorted = messages, cohorted
        self.judged = judged  # routing's verdicts of the tool results the messages end with (steps.AgentStep)
        self.chunks: list[bytes] | None = [] if tools else None  # a stream's tool-call events, as relayed
        self.raw: bytes | None = None  # a non-streamed body that may hold tool calls
        self.ex: Exchange | None = None
        self.status, self.elapsed_s, self.end_ns = 0, 0.0, 0
        self.ttft_s: float | None = None
        self.spans: Spans | None = None  # the exporter the exchange would have recorded its span with
        self.outcome: bool | None = None  # the run's outcome its `x-session-outcome` header reports (last step)
        self.sent = tr.Sent()  # the request's messages as the record takes them, once distilled
        self.calls: tuple[tr.ToolCall, ...] | None = None  # the response's tool calls, once read
        self.kept_bytes = 0  # tool-call bytes kept for the flusher after `distill`
        self.cache: tr.StepCache | None = None  # the session caches' view of the step (server/session_caches.py)

    def finished(self, ex: Exchange, status: int, elapsed_s: float, ttft_s: float | None,
                 spans: Spans | None, end_ns: int) -> None:
        self.ex, self.elapsed_s, self.ttft_s, self.end_ns = ex, elapsed_s, ttft_s, end_ns
        self.spans = spans
        self.status = ex.error.status if ex.error is not None and status == 200 else status
        self.queue(self)

    def distill(self, keep: bool, room_bytes: int) -> None:
        """Drop the request and keep its digests; keep the response's tool-call bytes for the flusher when they
        fit in MAX_KEPT_BYTES and the queue's `room_bytes`, else read the tool calls now and drop the bytes."""
        self.sent = tr.sent(self.messages, keep, self.judged)
        self.messages, self.judged = None, ()
        size = len(self.raw) if self.raw is not None else sum(len(c) for c in self.chunks or ())
        if size <= min(MAX_KEPT_BYTES, room_bytes):
            self.kept_bytes = size
        else:
            self.tool_calls(keep)

    def tool_calls(self, keep: bool) -> tuple[tr.ToolCall, ...]:
        """The response's tool calls (a non-streamed body's, or a stream's accumulated deltas), read once."""
        if self.calls is None:
            if self.raw is not None:
                self.calls = tr.tool_calls_in_body(self.raw, keep)
            else:
                self.calls = tr.tool_calls_in_stream(self.chunks, keep) if self.chunks else ()
            self.raw, self.chunks, self.kept_bytes = None, None, 0
        return self.calls


class StepReport(t.BatchedCounts):
    """Where judged steps are reported: the agent series (summed per flush, applied once the batch is judged), the
    rollout cohorts, spans."""

    def __init__(self, metrics: t.Metrics, record_process: Callable[..., None] | None = None) -> None:
        super().__init__(metrics.agents)
        self.record_process = record_process

    def count(self, p: PendingStep, step: Step, first: bool, grown_s: float) -> None:
        """The process metrics, per deployment and arm, and the rollout cohort's process counters."""
        labels = (step.deployment, step.arm or "none")
        self.add("steps", *labels)
        if first:
            self.add("sessions", *labels)
        if grown_s:
            self.add("session_seconds", *labels, by=grown_s)
        if step.cost_usd:
            self.add("cost", *labels, by=step.cost_usd)
        if step.tool_calls:
            self.add("tool_calls", *labels, by=len(step.tool_calls))
            self.add("steps_with_tool_calls", *labels)
        if step.rework:
            self.add("repeated_tool_calls", *labels)
        errors = sum(1 for r in step.tool_results if not r.ok)
        if errors:
            self.add("tool_results", *labels, "error", by=errors)
        if len(step.tool_results) > errors:
            self.add("tool_results", *labels, "ok", by=len(step.tool_results) - errors)
        c = p.cohorted
        if c is not None and self.record_process is not None:
            sample = ProcessSample(len(step.tool_results), errors, bool(step.tool_calls), step.rework)
            self.record_process(c.route, c.spec, c.state, c.cohort, sample)

    def flagged(self, p: PendingStep, step: Step, findings: list[Finding], raised: tuple[str, ...],
                loop_rules: LoopPolicy, spike_rules: SpikePolicy) -> list[SpanEvent]:
        """A newly raised flag: counted, logged, and an event on the step's span."""
        events: list[SpanEvent] = []
        for finding in findings:
            if finding.flag not in raised:
                continue
            action = loop_rules.action if finding.flag.startswith("loop:") else spike_rules.action
            self.add("flags", p.tenant, finding.flag, action)
            log.warning("agent session %r (tenant %r), step %d: %s: %s; action: %s", shown_id(p.session_id), p.tenant,
                        step.step, finding.flag, finding.detail, action)
            events.append((int(step.at * 1e9), t.AGENT_FLAG_EVENT,
                           {"gateway.agent.flag": finding.flag, "gateway.agent.action": action,
                            "gateway.agent.detail": finding.detail}))
        return events

    def record_span(self, p: PendingStep, step: Step, earlier: Sequence[Step], events: Sequence[SpanEvent]) -> None:
        ex, spans = p.ex, p.spans
        if spans is None or ex is None:
            return
        attrs = ex.attributes
        attrs[t.AGENT_STEP] = step.step
        if step.tool_calls:
            attrs[t.AGENT_TOOL_CALLS] = tuple(c.name for c in step.tool_calls)
        if step.flags:
            attrs[t.AGENT_FLAGS] = step.flags
        ex.record_span(spans, p.status, p.ttft_s, p.end_ns, events)
        if ex.trace is not None and step.tool_results:
            _tool_spans(spans, ex, p, step, earlier)

    def plain_span(self, p: PendingStep) -> None:
        """The span of a step that is not recorded, as it would have been without trajectories."""
        if p.spans is not None and p.ex is not None:
            p.ex.record_span(p.spans, p.status, p.ttft_s, p.end_ns)


def _tool_spans(spans: Spans, ex: Exchange, p: PendingStep, step: Step, earlier: Sequence[Step]) -> None:
    """One `execute_tool` span per tool output this step sent back: from the end of the step whose
    response asked for the call to the start of this one (the tool ran, as the gateway saw it, between)."""
    assert ex.trace is not None
    asked = {c.call_id: (s, c) for s in earlier[:-1] for c in s.tool_calls if c.call_id}
    for result in step.tool_results:
        hit = asked.get(result.tool_call_id)
        if hit is None:
            continue
        source, call = hit
        attrs: dict[str, Any] = {
            t.GEN_AI_OPERATION: "execute_tool", t.GEN_AI_TOOL_NAME: call.name,
            t.GEN_AI_TOOL_CALL_ID: result.tool_call_id, t.GEN_AI_TOOL_TYPE: "function",
            t.GEN_AI_CONVERSATION_ID: shown_id(p.session_id), t.TOOL_ARGS_DIGEST: call.args_digest,
        }  # fmt: skip
        if call.arguments is not None:
            attrs[t.GEN_AI_TOOL_CALL_ARGUMENTS] = call.arguments
        if result.content is not None:
            attrs[t.GEN_AI_TOOL_CALL_RESULT] = result.content
        if not result.ok:
            attrs[t.ERROR_TYPE] = "tool_error"
        start_ns = int((source.at + source.latency_ms / 1000) * 1e9)
        spans.record(f"execute_tool {call.name}", start_ns, attrs, None if result.ok else "tool error",
                     spans.child(ex.trace), end_ns=max(start_ns, ex.started_ns), kind=SpanKind.INTERNAL)

