"""One client request as the gateway saw it (the request record): timings, decision, outcome, usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.agents.trajectory import StepCache
from gateway.apis.chat.wire import StreamTally
from gateway.apis.usage import Usage
from gateway.decision.admission import ANONYMOUS
from gateway.decision.routing import Decision
from gateway.errors import GatewayError
from gateway.features import Features, count_tokens, prompt_tokens_with_template
from gateway.policy.model import Price
from gateway.telemetry import metrics as t
from gateway.telemetry.spans import SpanEvent, Spans, TraceContext


def span_name(endpoint: str) -> str:
    return "gateway " + endpoint


class StepHook(Protocol):
    """An agent step in the making (agents/recorder.py): told when its exchange ends, it records
    the exchange's span itself, later, with what the step adds."""

    chunks: list[bytes] | None  # a stream's tool-call events, kept by the relay; None: the request has no tools
    raw: bytes | None  # a non-streamed body the relay hands over when the request has tools
    cache: StepCache | None  # the step's prefix caches, set by the session caches and the warm-ups

    def finished(self, ex: Exchange, status: int, elapsed_s: float, ttft_s: float | None,
                 spans: Spans | None, end_ns: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Resume:
    """One break of a streamed answer and what became of it: resumed on `to`, or why not."""

    from_deployment: str
    to: str | None  # None: not resumed
    at_tokens: int  # tokens the client had been sent when the stream broke
    # resumed | failed (the continuation broke or failed) | refused (not faithful, or off) | ended (the answer had
    # finished: the gateway sent the stream's end)
    outcome: str
    reason: str = ""

    def describe(self) -> str:
        where = f"{self.from_deployment} -> {self.to or 'none'} at {self.at_tokens} tokens: {self.outcome}"
        return f"{where} ({self.reason})" if self.reason else where


class Exchange:
    """One client request as the gateway saw it: timings, decision, outcome; ends as one span and metrics.

    The span is recorded once at the end with every attribute (start time back-dated; see telemetry/spans.py).
    """

    __slots__ = (
        "attributes",
        "client_request_id",
        "compaction",
        "context_edits",
        "context_notes",
        "deployment",
        "endpoint",
        "error",
        "first_byte_at",
        "masked",
        "parts",
        "price",
        "prompt_tokens",
        "request_id",
        "response_model",
        "resumes",
        "retrieved",
        "rule",
        "sent",
        "side_parts",
        "started",
        "started_ns",
        "step",
        "summarized",
        "tap",
        "tenant",
        "trace",
        "tried",
        "usage",
    )

    def __init__(
        self, request_id: str, endpoint: str, operation: str, trace: TraceContext | None = None,
        client_request_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_request_id = client_request_id  # the client's own id: echoed and recorded, never a key
        self.endpoint = endpoint
        self.started = time.perf_counter()
        self.started_ns = time.time_ns()
        self.attributes: dict[str, Any] = {t.REQUEST_ID: request_id, t.GEN_AI_OPERATION: operation}
        if client_request_id is not None:
            self.attributes[t.CLIENT_REQUEST_ID] = client_request_id
        self.deployment: str | None = None
        self.rule: str | None = None
        self.tried: list[str] = []  # the deployments sent the request, in order (failover adds more)
        self.sent = False  # the current attempt's bytes reached a connection (the deployment may have it)
        self.response_model: str | None = None  # the model the answering deployment named in its answer
        self.price: Price | None = None  # the answering deployment's, for the spend by tenant
        self.tenant = ANONYMOUS
        self.first_byte_at: float | None = None
        self.usage: Usage | None = None
        self.prompt_tokens = 0  # the request's estimate, charged when a stream ends without usage
        self.error: GatewayError | None = None
        self.tap: list[bytes] | None = None  # set when a shadow compares against the relayed bytes
        self.trace = trace  # None when spans are off: the caller's traceparent then goes upstream as sent
        self.step: StepHook | None = None  # set when the request is an agent step being recorded
        # A stream finished by the sibling: the earlier parts' (deployment, price, usage), and each resume
        self.parts: list[tuple[str, Price | None, Usage]] | None = None
        self.resumes: list[Resume] | None = None
        self.context_edits: list[tuple[str, int]] = []  # (edit, input tokens it cleared): metrics at the end
        self.masked: tuple[int, int] | None = None  # (tool outputs masked, tokens saved): metrics at the end
        self.summarized: tuple[int, int] | None = None  # (old entries in the summary sent, tokens saved): the same
        self.retrieved: tuple[int, int] | None = None  # (pieces put back, the block's tokens): the same
        self.context_notes: dict[str, Any] | None = None  # the context rules' part of the decision trail
        # Calls made for this request beside its answer (a compaction's summary): (deployment, price, usage)
        self.side_parts: list[tuple[str, Price | None, Usage]] | None = None
        # Who asked for the compaction this request is or made (v1_compact, v2_trigger, context_management,
        # anthropic_compact, or an agent's own: codex, claude-code), and whether the whole answer is it
        self.compaction: tuple[str, bool] | None = None

    def decided(self, features: Features, decision: Decision, complexity: float | None) -> None:
        """The decision as admission left it; the deployment is set only once one is tried (a call the budget
        refused reached none)."""
        self.rule = decision.rule
        self.prompt_tokens = prompt_tokens_with_template(features)
        attrs = self.attributes
        attrs[t.GEN_AI_REQUEST_MODEL] = features.requested_model
        attrs[t.RULE] = decision.rule
        attrs[t.REASONS] = decision.reasons
        if features.max_tokens is not None:
            attrs[t.GEN_AI_REQUEST_MAX_TOKENS] = features.max_tokens
        if features.temperature is not None:
            attrs[t.GEN_AI_REQUEST_TEMPERATURE] = features.temperature
        if complexity is not None:
            attrs[t.COMPLEXITY] = complexity

    def edited(self, edits: Sequence[tuple[str, int, int]], tokens_before: int | None,
               tokens_after: int | None) -> None:
        """The context edits made to the prompt: (edit, what it cleared, the input tokens that freed) each, and
        the prompt's tokens before and after them when they were counted."""
        self.context_edits = [(edit, tokens) for edit, _, tokens in edits]
        attrs = self.attributes
        attrs[t.CONTEXT_EDITS] = tuple(f"{edit}: cleared {n}, {tokens} tokens" for edit, n, tokens in edits)
        if tokens_before is not None and tokens_after is not None:
            attrs[t.CONTEXT_TOKENS_BEFORE] = tokens_before
            attrs[t.CONTEXT_TOKENS_AFTER] = tokens_after

    def masked_outputs(self, masked: int, tokens_saved: int, frontier: int) -> None:
        """The old tool outputs the policy's context rules sent as stubs in this prompt."""
        self.masked = (masked, tokens_saved)
        attrs = self.attributes
        attrs[t.CONTEXT_MASKED] = masked
        attrs[t.CONTEXT_MASKED_TOKENS] = tokens_saved
        attrs[t.CONTEXT_MASK_FRONTIER] = frontier

    def summarized_turns(self, entries: int, tokens_saved: int, due: int, ready: bool) -> None:
        """The summary of old turns the policy's context rules sent in this prompt (entries: 0 when none yet)."""
        if entries:
            self.summarized = (entries, tokens_saved)
        self.noted("summarize_old_turns", {"summarized_entries": entries, "tokens_saved": tokens_saved,
                                           "span_due_before_entry": due, "ready": ready})
        attrs = self.attributes
        attrs[t.CONTEXT_SUMMARIZED] = entries
        attrs[t.CONTEXT_SUMMARY_TOKENS] = tokens_saved
        attrs[t.CONTEXT_SUMMARY_DUE] = due
        attrs[t.CONTEXT_SUMMARY_READY] = ready

    def retrieved_pieces(self, pieces: int, tokens: int, described: dict[str, Any]) -> None:
        """The pieces retrieval put back at the prompt's end (pieces 0: it found candidates, none relevant)."""
        if pieces:
            self.retrieved = (pieces, tokens)
        self.noted("retrieve", described)
        self.attributes[t.CONTEXT_RETRIEVED] = pieces
        self.attributes[t.CONTEXT_RETRIEVED_TOKENS] = tokens

    def context_managed_again(self) -> None:
        """A rollout's candidate policy manages the prompt anew: what the live rules did no longer stands."""
        self.summarized = self.retrieved = self.context_notes = None

    def noted(self, rule: str, described: dict[str, Any]) -> None:
        """What a context rule did, for the decision trail (/admin/requests/{id}/explain)."""
        self.context_notes = {**(self.context_notes or {}), rule: described}

    def side_call(self, deployment: str, price: Price | None, usage: Usage, metrics: t.Metrics,
                  compaction: str | None = None) -> None:
        """A call made for this request beside its answer (the summary of the compaction `compaction` asked
        for): its tokens and cost counted now, and charged to the tenant with the answer's."""
        cost_usd = price.cost_usd_of(usage) if price is not None else 0.0
        metrics.count_tokens(deployment, self.tenant, usage, cost_usd)
        if compaction is not None:
            self.compaction = (compaction, False)
            metrics.compaction_cost_usd.labels(compaction, deployment).inc(cost_usd)
        if self.side_parts is None:
            self.side_parts = []
        self.side_parts.append((deployment, price, usage))

    def trying(self, deployment: str) -> None:
        self.tried.append(deployment)
        self.deployment, self.sent = deployment, False

    def reached(self) -> None:
        """The attempt's request was handed to the deployment's connection."""
        self.sent = True

    def answered(self, deployment: str, model: str | None, price: Price | None = None) -> None:
        """The deployment whose answer the client gets (after any failover), the model it named, its price."""
        self.deployment, self.response_model, self.price = deployment, model, price

    def first_byte(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()

    def settle(
        self, usage: Usage | None, metrics: t.Metrics, streamed: StreamTally | None = None, cut: bool = False
    ) -> None:
        """Keep a finished exchange's usage and count its tokens and cost: the deployment's (exact), else, for a
        stream that ended without it (client gone, deployment died), the prompt and the tokens it streamed
        (a `cut` stream is charged its prompt even before its first event: the deployment had the call)."""
        if usage is None and streamed is not None and (cut or streamed.events):
            usage = Usage(self.prompt_tokens, streamed.completion_tokens(count_tokens), estimated=True)
        self.usage = usage
        if usage is not None and self.deployment is not None:
            cost_usd = self.price.cost_usd_of(usage) if self.price is not None else 0.0
            metrics.count_tokens(self.deployment, self.tenant, usage, cost_usd)
            if self.compaction is not None and self.compaction[1]:
                metrics.compaction_cost_usd.labels(self.compaction[0], self.deployment).inc(cost_usd)

    def cost_usd(self) -> tuple[float, float]:
        """What this request cost in all (its answer, a resumed stream's earlier parts, calls beside it), and the
        part of that which went to a compaction."""
        def priced(price: Price | None, usage: Usage) -> float:
            price = price or self.price
            return price.cost_usd_of(usage) if price is not None else 0.0

        answer = priced(self.price, self.usage) if self.usage is not None else 0.0
        parts = sum(priced(price, usage) for _, price, usage in self.parts or ())
        beside = sum(priced(price, usage) for _, price, usage in self.side_parts or ())
        whole = self.compaction is not None and self.compaction[1]
        return answer + parts + beside, (answer + parts + beside if whole else beside if self.compaction else 0.0)

    def part_ended(self, usage: Usage, metrics: t.Metrics) -> None:
        """The answering deployment's part of a stream that another deployment goes on with: charged at its price."""
        assert self.deployment is not None
        cost_usd = self.price.cost_usd_of(usage) if self.price else 0.0
        metrics.count_tokens(self.deployment, self.tenant, usage, cost_usd)
        if self.parts is None:
            self.parts = []
        self.parts.append((self.deployment, self.price, usage))

    def resumed(self, resume: Resume) -> None:
        if self.resumes is None:
            self.resumes = []
        self.resumes.append(resume)

    def failed_mid_stream(self, err: GatewayError) -> None:
        self.error = err

    def finish(self, status: int, metrics: t.Metrics, spans: Spans | None) -> None:
        """The request ends now; its metrics and span are recorded once its response is written (called once,
        by the middleware, before aiohttp writes the response: a client at concurrency 1 need not wait for
        the recording)."""
        elapsed_s, end_ns = time.perf_counter() - self.started, time.time_ns()
        asyncio.get_running_loop().call_soon(self._record, status, metrics, spans, elapsed_s, end_ns)

    def _record(self, status: int, metrics: t.Metrics, spans: Spans | None, elapsed_s: float, end_ns: int) -> None:
        ttft_s = None if self.first_byte_at is None else self.first_byte_at - self.started
        shown_status = "stream_error" if self.error is not None and status == 200 else str(status)
        metrics.observe_request(self.endpoint, self.deployment or "none", self.rule or "none", shown_status,
                                elapsed_s, ttft_s)
        for edit, cleared_tokens in self.context_edits:
            metrics.count_context_edit(self.endpoint, edit, cleared_tokens)
        if self.masked is not None:
            metrics.count_masking(self.endpoint, *self.masked)
        if self.summarized is not None:
            metrics.count_summarized(self.endpoint, *self.summarized)
        if self.retrieved is not None:
            metrics.context_retrieved_tokens.labels(self.endpoint).inc(self.retrieved[1])
        step, self.step = self.step, None
        if step is not None:
            # handed over: the step keeps the exchange (its span is recorded with the step), and no longer the
            # other way round: a cycle of the two would outlive the request until the collector's next pass
            step.finished(self, status, elapsed_s, ttft_s, spans, end_ns)
        elif spans is not None:
            self.record_span(spans, status, ttft_s, end_ns)

    def record_span(self, spans: Spans, status: int, ttft_s: float | None, end_ns: int | None = None,
                    events: Sequence[SpanEvent] = ()) -> None:
        attrs = self.attributes
        attrs["http.response.status_code"] = status
        attrs[t.DEPLOYMENT] = self.deployment or ""
        attrs[t.ATTEMPTS] = tuple(self.tried)
        if self.response_model:
            attrs[t.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.usage is not None:
            attrs[t.GEN_AI_INPUT_TOKENS] = self.usage.prompt_tokens
            attrs[t.GEN_AI_OUTPUT_TOKENS] = self.usage.completion_tokens
            if self.usage.cached_tokens:
                attrs[t.GEN_AI_CACHE_READ_INPUT_TOKENS] = self.usage.cached_tokens
        if ttft_s is not None:
            attrs[t.TTFT_MS] = ttft_s * 1000
        if self.resumes:
            attrs[t.RESUMES] = tuple(r.describe() for r in self.resumes)
            attrs[t.REASONS] = (*attrs.get(t.REASONS, ()), *(f"resume: {r.describe()}" for r in self.resumes))
            attrs[t.RESUMED_AT_TOKENS] = tuple(r.at_tokens for r in self.resumes)
        failed = status >= 500 or self.error is not None
        error = (self.error.message if self.error else str(status)) if failed else None
        spans.record(span_name(self.endpoint), self.started_ns, attrs, error, self.trace, end_ns=end_ns,
                     events=events)
