"""One OpenTelemetry span per request, recorded finished, and exported from the event loop as OTLP/HTTP JSON.

Why not `tracer.start_span(...)`/`span.end()` and the SDK's BatchSpanProcessor with its OTLP exporter:
on the 2-core machine this gateway is measured on, the live-span path cost ~40 µs per span, the protobuf
encoder ~100 µs per span, and, worse, the export thread's encoding competes with the event loop for the
GIL: with only the encoding moved there, throughput fell by a quarter. A request's span is only ever
created once it is over, with every attribute known and of a valid type, so it is built directly as the
SDK's ReadableSpan (a few µs), or for `otlp` queued as its fields and encoded to OTLP JSON text when its
batch is posted: encoded in a loop with its batch, a span costs about half of what encoding it amid its
own request did (thread_time in the running gateway: ~17 against ~31 µs). A task on the
event loop encodes and posts them in batches over the gateway's own connection pool.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from gateway import __version__
from gateway.telemetry.otlp import SpanEvent, request_json, resource_spans_json, span_json, span_text
from gateway.upstream.client import ClientError, Pool

log = logging.getLogger(__name__)

DEFAULT_OTLP_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_SAMPLE = Decision.RECORD_AND_SAMPLE


@dataclass(slots=True)
class TraceContext:
    """One request's place in a trace: its span's ids, the caller's span (from `traceparent`), sampled or not."""

    trace_id: int
    span_id: int
    parent_span_id: int | None = None
    sampled: bool = True

    def traceparent(self) -> str:
        """The W3C header that makes this request's span the parent of the deployment's."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


# W3C trace context, version 00 (later versions may append fields): version-trace id-parent id-flags
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(header: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid `traceparent` header, else None (a new trace starts)."""
    found = _TRACEPARENT.fullmatch(header.strip()) if header else None
    if found is None or found[1] == "ff" or (found[1] == "00" and found[5]):
        return None
    trace_id, parent_id = int(found[2], 16), int(found[3], 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(found[4], 16) & 1)


class Spans:
    """Records finished request spans into a span processor (which batches and exports them)."""

    def __init__(self, processor: SpanProcessor, resource: Resource | None = None,
                 sampler: Sampler | None = None) -> None:
        self.processor = processor
        self._resource = resource or Resource.create({"service.name": "agent-gateway"})
        self._scope = InstrumentationScope("agent-gateway", __version__)
        self._sampler = sampler  # None: every span is kept (OTEL_TRACES_SAMPLER unset)
        self._ids = random.Random()

    def begin(self, name: str, traceparent: str | None = None) -> TraceContext:
        """A request's trace context: the caller's trace continued when it sent a valid `traceparent`, else a
        new one; sampled by OTEL_TRACES_SAMPLER (a parent-based one reads the caller's flag), else always."""
        parent = parse_traceparent(traceparent)
        trace_id = parent[0] if parent else self._ids.getrandbits(128) or 1  # zero is the invalid id
        context = TraceContext(trace_id, self._ids.getrandbits(64) or 1, parent[1] if parent else None)
        if self._sampler is not None:
            context.sampled = self._sampler.should_sample(
                _remote_parent(*parent) if parent else None, trace_id, name).decision == _SAMPLE
        return context

    def record(self, name: str, start_ns: int, attributes: Mapping[str, Any], error: str | None = None,
               trace: TraceContext | None = None, *, end_ns: int | None = None, events: Sequence[SpanEvent] = (),
               kind: SpanKind = SpanKind.SERVER) -> None:
        """A finished span, in the trace `begin` placed it in (a new trace when None); it ends now unless
        `end_ns` says when (a span recorded later than it ended, e.g. with its agent step)."""
        trace = trace or self.begin(name)
        if not trace.sampled:
            return
        end_ns = end_ns or time.time_ns()
        if isinstance(self.processor, LoopExport):
            self.processor.add((trace.trace_id, trace.span_id, trace.parent_span_id, name, start_ns,
                                end_ns, attributes, error, kind, events))
            return
        context = SpanContext(trace.trace_id, trace.span_id, is_remote=False, trace_flags=_SAMPLED)
        parent = None if trace.parent_span_id is None else SpanContext(
            trace.trace_id, trace.parent_span_id, is_remote=True, trace_flags=_SAMPLED)
        status = _OK if error is None else Status(StatusCode.ERROR, error)
        span = ReadableSpan(name, context, parent, self._resource, attributes, kind=kind,
                            status=status, start_time=start_ns, end_time=end_ns,
                            events=[Event(event, attrs, at_ns) for at_ns, event, attrs in events],
                            instrumentation_scope=self._scope)
        self.processor.on_end(span)

    def child(self, parent: TraceContext) -> TraceContext:
        """A new span's place under `parent` (in its trace, sampled as it is)."""
        return TraceContext(parent.trace_id, self._ids.getrandbits(64) or 1, parent.span_id, parent.sampled)

    def start(self) -> None:
        if isinstance(self.processor, LoopExport):
            self.processor.start()

    async def close(self) -> None:
        """Export what is still queued, then stop."""
        if isinstance(self.processor, LoopExport):
            await self.processor.close()
        else:
            await asyncio.to_thread(self.processor.shutdown)  # the SDK's processor flushes synchronously


def make_spans(exporter_name: str, pool: Pool) -> Spans | None:
    """`none`: no spans; `console` prints them; `otlp` (JSON, from the event loop) and `otlp-protobuf`
    (the SDK's exporter, from a thread) read OTEL_EXPORTER_OTLP_*."""
    # The SDK's provider reads OTEL_RESOURCE_ATTRIBUTES and OTEL_TRACES_SAMPLER* as usual.
    provider = TracerProvider(resource=Resource.create({"service.name": "agent-gateway",
                                                        "service.version": __version__}))
    processor = _processor(exporter_name, pool, provider.resource)
    if processor is None:
        return None
    sampler = provider.sampler if os.environ.get("OTEL_TRACES_SAMPLER") else None
    return Spans(processor, provider.resource, sampler)


def _processor(name: str, pool: Pool, resource: Resource) -> SpanProcessor | None:
    if name == "otlp":
        endpoint, headers = otlp_destination()
        return LoopExport(pool, endpoint, headers, resource=resource, **batching())
    exporter: SpanExporter | None = None
    if name == "console":
        exporter = ConsoleSpanExporter()
    elif name == "otlp-protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("traces=otlp-protobuf needs opentelemetry-exporter-otlp-proto-http; not exporting spans")
            return None
        exporter = OTLPSpanExporter(endpoint=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    return BatchSpanProcessor(exporter) if exporter is not None else None


def otlp_destination() -> tuple[str, dict[str, str]]:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces; *_HEADERS k=v,..."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    raw = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return endpoint or DEFAULT_OTLP_TRACES_ENDPOINT, {unquote(k.strip()): unquote(v.strip()) for k, v in pairs}


# OpenTelemetry's batch processor variables, read as the SDK reads them (ms for times), and LoopExport's option each
# sets; unset (or not a positive number: logged), LoopExport's own default holds.
BATCH_VARIABLES = {"OTEL_BSP_SCHEDULE_DELAY": "delay_s", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "batch_size",
                   "OTEL_BSP_MAX_QUEUE_SIZE": "max_queue", "OTEL_BSP_EXPORT_TIMEOUT": "timeout_s"}


def batching() -> dict[str, Any]:
    """LoopExport's options from the OTEL_BSP_* variables that are set."""
    options: dict[str, Any] = {}
    for variable, option in BATCH_VARIABLES.items():
        raw = os.environ.get(variable)
        if raw is None or not raw.strip():
            continue
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if not math.isfinite(value) or value <= 0:
            log.warning("%s=%r is not a positive number; using the default", variable, raw)
            continue
        options[option] = value / 1000 if option.endswith("_s") else int(value)
    return options


# Spans encoded between two yields to the event loop: ~0.1 ms (64 took ~0.5 ms with a cold cache: at one request
# at a time, the request that came in meanwhile waited that long, a batch's eight slices twice a second).
ENCODE_SLICE = 16

# A finished span as Spans.record hands it over: trace id, span id, parent span id (None: a root), name,
# start and end (ns since the epoch), attributes, error message (None: not an error), kind, events.
FinishedSpan = tuple[int, int, int | None, str, int, int, Mapping[str, Any], str | None, SpanKind,
                     Sequence[SpanEvent]]


def _encoded(span: str | FinishedSpan) -> str:
    if isinstance(span, str):
        return span
    trace_id, span_id, parent_span_id, name, start_ns, end_ns, attributes, error, kind, events = span
    return span_text(trace_id, span_id, name, kind, start_ns, end_ns, attributes, parent_span_id, error, events)


def _remote_parent(trace_id: int, span_id: int, sampled: bool) -> Context:
    """The caller's span as the OpenTelemetry context a parent-based sampler reads."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return set_span_in_context(NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)))


class LoopExport(SpanProcessor):
    """Batches encoded spans (all of one resource and scope) and posts them as OTLP/HTTP JSON from the loop.

    Bounded: at most `max_queue` spans wait (newer ones are dropped and counted);
    a failed post is logged (endpoint only: the headers may carry a collector's key) and its batch dropped.
    """

    def __init__(self, pool: Pool, endpoint: str, headers: Mapping[str, str] | None = None, *,
                 resource: Resource | None = None, batch_size: int = 512, delay_s: float = 2.0,
                 max_queue: int = 8192, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.dropped = 0
        self.exported = 0
        self._pool = pool
        self._headers = {"content-type": "application/json", **(headers or {})}
        self._resource = resource or Resource.create({"service.name": "agent-gateway"})
        self._scope = InstrumentationScope("agent-gateway", __version__)
        self._batch_size, self._delay_s, self._max_queue, self._timeout_s = batch_size, delay_s, max_queue, timeout_s
        self._queue: collections.deque[str | FinishedSpan] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        self.add(span_json(span))

    def add(self, span: str | FinishedSpan) -> None:
        """One server span, in OTLP JSON already or as its fields (encoded with its batch); the attributes
        mapping must not change after this."""
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return
        self._queue.append(span)
        if len(self._queue) >= self._batch_size:
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                await self.flush()

    def shutdown(self) -> None:
        return None  # the loop's task ends in close(); nothing runs on a thread

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # asynchronous: see flush()

    async def flush(self) -> None:
        while self._queue:
            await self._export_batch()

    async def _run(self) -> None:
        """Whole batches as soon as they fill, what is left once no batch filled for delay_s. Flushing all on
        every wake-up posted, under load, the few spans that arrived during the previous post: batches of ~15
        spans, whose posting cost the gateway more than encoding them (~15% of the CPU of a request)."""
        while True:
            waited = False
            try:
                async with asyncio.timeout(self._delay_s):
                    await self._wake.wait()
            except TimeoutError:
                waited = True
            self._wake.clear()
            if waited:
                await self.flush()
            while len(self._queue) >= self._batch_size:
                await self._export_batch()

    async def _encode_batch(self) -> list[str]:
        """The next batch as OTLP JSON, encoded a slice at a time so requests run in between (a whole
        batch is a few ms of work); cancelled midway, the encoded spans go back to the queue's head."""
        count = min(self._batch_size, len(self._queue))
        spans: list[str] = []
        try:
            while len(spans) < count:
                spans.extend(_encoded(self._queue.popleft()) for _ in range(min(ENCODE_SLICE, count - len(spans))))
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._queue.extendleft(reversed(spans))
            raise
        return spans

    async def _export_batch(self) -> None:
        spans = await self._encode_batch()
        body = request_json([resource_spans_json(self._resource, self._scope, spans)])
        await asyncio.sleep(0)  # joining a batch's ~0.5 MB and writing it out are each ~0.3 ms: not in one go
        try:
            reply = await self._pool.request("POST", self.endpoint, body, self._headers,
                                             connect_s=self._timeout_s, read_s=self._timeout_s,
                                             total_s=self._timeout_s)
            await reply.read()
        except (TimeoutError, ClientError) as exc:
            log.warning("could not export %d spans to %s: %s", len(spans), self.endpoint, exc)
            return
        if reply.status >= 300:
            log.warning("could not export %d spans to %s: HTTP %d", len(spans), self.endpoint, reply.status)
            return
        self.exported += len(spans)
