"""Shadow dispatch: mirror a request to a target in the background, bounded and isolated; compare the pair.

The client never waits for a shadow: `mirror` only starts a task (or drops the shadow, counted by reason)
and returns. A shadow has a hard timeout, a max_tokens cap, no retries, no failover, a per-target
in-flight cap and a circuit breaker; it never touches tenant budgets, carries `x-gateway-shadow: 1`, and
loses the body fields that would persist state upstream. It is in the request's trace: with spans on, a
`shadow <target>` span under the request's, the parent of the shadow deployment's own spans; with spans off,
the caller's `traceparent` as sent, as the primary's deployment gets it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind

from gateway.apis.chat import wire as chat_wire
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.features import Features
from gateway.policy.model import Deployment
from gateway.rollout.comparison import Capture, compare
from gateway.rollout.samples import PairOutcome
from gateway.store.contract import StoreError
from gateway.store.pairs import ShadowPairStore
from gateway.telemetry import metrics as t
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.spans import Spans, TraceContext
from gateway.upstream import forward as upstream
from gateway.upstream.client import Pool

log = logging.getLogger(__name__)

TAG_HEADER = "x-gateway-shadow"
# Body fields that make the deployment keep something (a stored response, a conversation, KV blocks to
# transfer): a shadow must leave no trace a later real request could see.
STATEFUL_FIELDS = (
    "store",
    "metadata",
    "previous_response_id",
    "conversation",
    "background",
    "kv_transfer_params",
)
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, forwarded as sent when spans are off
SHADOW_TARGET = "gateway.shadow.target"  # the shadow span's target as the policy declares it
PAIRS_MAXLEN = 10_000  # per target, in the Redis stream (approximate) or the in-memory deque
BREAKER_FAILURES = 5  # consecutive shadow failures that open a target's circuit
BREAKER_OPEN_S = 30.0
PRIMARY_WAIT_S = 600.0  # a pair whose primary never finishes (client gone) is not compared
# A shadow's answer is read whole to be compared, but never past this: its max_tokens cap keeps a sound
# answer far below (512 tokens streamed are ~150 KB); a deployment that sends more is cut off there.
SHADOW_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ShadowLimits:
    """A shadow's isolation limits (from a ShadowSpec, or the defaults for a rollout's shadow step)."""

    max_in_flight: int = 8
    timeout_s: float = 30.0
    max_tokens: int = 512
    max_body_bytes: int = SHADOW_MAX_BODY_BYTES


@dataclass(slots=True)
class Breaker:
    """Consecutive failures open the circuit for a while; then one probe decides (half-open)."""

    failures: int = 0
    open_until: float = 0.0
    probing: bool = False

    def allows(self, now: float) -> bool:
        if self.failures < BREAKER_FAILURES:
            return True
        if now < self.open_until or self.probing:
            return False
        self.probing = True
        return True

    def record(self, ok: bool, now: float) -> None:
        self.probing = False
        self.failures = 0 if ok else self.failures + 1
        if self.failures >= BREAKER_FAILURES:
            self.open_until = now + BREAKER_OPEN_S


@dataclass(frozen=True, slots=True)
class Pair:
    """A compared pair, as handed to the labeller: the request, both sides' answers and compare()'s record."""

    target: str
    request_id: str
    body: Mapping[str, Any]
    features: Features | None
    record: Mapping[str, Any]
    primary: Capture
    shadow: Capture


@dataclass(frozen=True, slots=True)
class ShadowCall:
    """One shadow to send: the target as declared, the deployment it resolved to, the request as the primary got
    it, and the rollout window its pair counts in (None: a standing shadow's pair counts in none)."""

    target: str
    name: str
    dep: Deployment
    path: str
    body: Mapping[str, Any]
    request_id: str
    limits: ShadowLimits
    samples_key: str | None = None
    features: Features | None = None
    trace: TraceContext | None = None  # the request's place in its trace (None: spans off)
    caller_trace: Mapping[str, str] = field(default_factory=dict)  # the caller's TRACE_HEADERS as sent


@dataclass(slots=True)
class TargetState:
    in_flight: int = 0
    breaker: Breaker = field(default_factory=Breaker)


def shadow_body(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """The client's body minus stateful fields, max_tokens capped (streaming kept as the client asked)."""
    out = {k: v for k, v in body.items() if k not in STATEFUL_FIELDS}
    capped = False
    for name in ("max_tokens", "max_completion_tokens"):
        value = out.get(name)
        if isinstance(value, int):
            out[name] = min(value, max_tokens)
            capped = True
    if not capped:
        out["max_tokens"] = max_tokens
    return out


class Shadows:
    """Every shadow target's in-flight count and breaker; the tasks in flight; the pair sink."""

    def __init__(
        self,
        client: Pool,
        store: ShadowPairStore,
        metrics: Metrics,
        on_outcome: Callable[[str, PairOutcome], None] | None = None,
        on_pair: Callable[[Pair], None] | None = None,
        spans: Callable[[], Spans | None] = lambda: None,
    ) -> None:
        self._client, self._store, self._on_outcome, self._on_pair = client, store, on_outcome, on_pair
        self._spans = spans  # asked at each shadow: the app's span exporter (None: spans off)
        self._targets: dict[str, TargetState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.dropped, self.sent, self.outcomes = metrics.shadow_dropped, metrics.shadow_sent, metrics.shadow_pairs

    def drop(self, target: str, reason: str) -> None:
        self.dropped.labels(target, reason).inc()

    def mirror(self, call: ShadowCall, primary: Callable[[], asyncio.Future[Capture]]) -> bool:
        """Start one shadow unless the target is saturated or its circuit is open; never waits. `primary` asks
        for the primary's capture (the relay then copies its bytes), only for a shadow that is sent."""
        target, limits = call.target, call.limits
        state = self._targets.setdefault(target, TargetState())
        if state.in_flight >= limits.max_in_flight:
            self.drop(target, "in_flight_cap")
            return False
        if not state.breaker.allows(time.monotonic()):
            self.drop(target, "circuit_open")
            return False
        state.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._shadow(call, primary()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _shadow(self, call: ShadowCall, primary: asyncio.Future[Capture]) -> None:
        target, state = call.target, self._targets[call.target]
        try:
            capture = dataclasses.replace(await self._call(call), deployment=call.name)
        finally:
            state.in_flight -= 1
        ok = capture.error is None and 200 <= capture.status < 300
        state.breaker.record(ok, time.monotonic())
        self.sent.labels(target, "ok" if ok else ("timeout" if capture.error == "timeout" else "error")).inc()
        try:
            primary_capture = await asyncio.wait_for(asyncio.shield(primary), PRIMARY_WAIT_S)
        except (TimeoutError, asyncio.CancelledError):
            return
        record = await self._record(call, primary_capture, capture)
        if self._on_pair is not None:
            self._on_pair(Pair(target, call.request_id, call.body, call.features, record, primary_capture, capture))

    async def _call(self, call: ShadowCall) -> Capture:
        spans = self._spans()
        trace = spans.child(call.trace) if spans is not None and call.trace is not None else None
        started_ns = time.time_ns()
        capture = await self._fetch(call, trace)
        if spans is not None and trace is not None:
            attrs: dict[str, Any] = {SHADOW_TARGET: call.target, t.DEPLOYMENT: call.name, t.REQUEST_ID: call.request_id}
            if capture.error is None:  # else no answer came to read (the error says what the deployment did)
                attrs["http.response.status_code"] = capture.status
            error = capture.error or (None if 200 <= capture.status < 300 else str(capture.status))
            spans.record(f"shadow {call.target}", started_ns, attrs, error, trace, kind=SpanKind.CLIENT)
        return capture

    async def _fetch(self, call: ShadowCall, trace: TraceContext | None) -> Capture:
        body, limits, dep = call.body, call.limits, call.dep
        payload, _ = chat_wire.upstream_body(shadow_body(body, limits.max_tokens), dep.served_model)
        headers = {TAG_HEADER: "1", "x-request-id": f"{call.request_id}-shadow"}
        if trace is not None:  # the shadow deployment's spans become children of the shadow's span
            trace.inject(headers)
        else:
            headers.update(call.caller_trace)
        started = time.perf_counter()
        try:
            got = await upstream.fetch(self._client, call.name, dep, call.path, payload, headers,
                                       timeout_s=limits.timeout_s, limit_bytes=limits.max_body_bytes)
        except UpstreamTimeout:
            return Capture(0, _ms_since(started), error="timeout")
        except GatewayError as exc:
            return Capture(exc.status, _ms_since(started), error=exc.message)
        streamed = bool(body.get("stream")) and got.status == 200
        return parse_capture(got.status, got.total_ms, got.first_byte_ms if streamed else None, got.body, streamed)

    async def _record(self, call: ShadowCall, primary: Capture, shadow: Capture) -> dict[str, Any]:
        target = call.target
        record = compare(call.body, primary, shadow, call.limits.max_tokens)
        record.update(target=target, request_id=call.request_id, at=round(time.time(), 3))
        outcome = PairOutcome(record["outcome"])
        self.outcomes.labels(target, outcome.value).inc()
        if call.samples_key is not None and self._on_outcome is not None:
            self._on_outcome(call.samples_key, outcome)
        try:
            await self._store.add_pair(target, json.dumps(record, separators=(",", ":")), PAIRS_MAXLEN)
        except StoreError as exc:
            self.drop(target, "store_unavailable")
            log.debug("shadow pair of %s not kept: %s", call.request_id, exc)
        return record

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def parse_capture(
    status: int, total_ms: float, ttft_ms: float | None, raw: bytes, stream: bool, deployment: str | None = None
) -> Capture:
    """The primary's side of a pair from the bytes the gateway relayed to the client."""
    if not stream:
        return Capture(status, total_ms, ttft_ms, _json(raw), deployment=deployment)
    events, _ = chat_wire.split_events(raw)
    chunks = [d for d in map(_event_json, events) if isinstance(d, dict)]
    return Capture(status, total_ms, ttft_ms, None, chunks, deployment=deployment)


def _event_json(event: bytes) -> Any:
    if event.startswith(chat_wire.DONE_EVENT):
        return None
    try:
        return chat_wire.event_data(event)
    except ValueError:
        return None


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
