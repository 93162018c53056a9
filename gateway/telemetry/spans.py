"""One OpenTelemetry span per request, built once the request is over and exported by the SDK's own processors.

The span is made with every attribute known, start time back-dated, as the SDK's ReadableSpan, and handed to
the SDK's BatchSpanProcessor, whose thread batches it and whose exporter (OTLP/HTTP protobuf, or the console)
sends it; OTLP's processor and exporter run in a process of their own (`export_process`). Made that way rather
than with `tracer.start_span` at the request's start and `end()` at its end: the live span validates and locks
each attribute write (see docs/native-and-spans.md for the measured difference). The
request's place in its trace comes first (`begin`): the caller's W3C `traceparent` read by the SDK's
propagator, ids from the SDK's id generator, the keep-or-drop decision from the SDK's sampler (OTEL_TRACES_SAMPLER,
parent-based by default), so the deployment's spans can be children of this one before it exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import __version__
from gateway.telemetry.export_process import DEFAULT_NICE, ExportProcess

log = logging.getLogger(__name__)

SpanEvent = tuple[int, str, Mapping[str, Any]]  # (time in ns since the epoch, name, attributes)

_W3C = TraceContextTextMapPropagator()
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_OK = Status(StatusCode.UNSET)
_NO_HEADERS: Mapping[str, str] = {}
# In the serving process (the console exporter), exports in batches four times the SDK's 512 (and a queue that
# holds two of them): each export stalls the event loop for a moment (its encoding in the export thread takes the
# GIL), and at c=1 on small chat the stalls of 512-span batches were the gateway's p99 (docs/telemetry.md). The
# export process (otlp) keeps the SDK's 512. OTEL_BSP_* still override both.
_DEFAULT_MAX_QUEUE = 4096
_DEFAULT_BATCH = 2048
_SDK_BATCH = 512
SCOPE = InstrumentationScope("agent-gateway", __version__)  # every span's instrumentation scope


@dataclass(frozen=True, slots=True)
class TraceContext:
    """One span's place in a trace: its own context (ids, sampled flag, the caller's tracestate) and its parent's
    (the caller's span from `traceparent`, or the request's span for a child; None: a new trace's root)."""

    span: SpanContext
    parent: SpanContext | None = None

    @property
    def sampled(self) -> bool:
        return self.span.trace_flags.sampled

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """`traceparent` (and the caller's `tracestate`) that make this span the parent of the deployment's."""
        _W3C.inject(headers, set_span_in_context(NonRecordingSpan(self.span)))


class SpanSink(Protocol):
    """Where finished spans go: the SDK's span processor (console, tests) or the export process (otlp)."""

    def on_end(self, span: ReadableSpan) -> None: ...


class Spans:
    """Places requests in their traces and hands their finished spans to a span processor."""

    def __init__(self, processor: SpanSink, resource: Resource | None = None,
                 sampler: Sampler | None = None, ids: IdGenerator | None = None) -> None:
        self.processor = processor
        self._resource = resource or Resource.create({"service.name": "agent-gateway"})
        self._scope = SCOPE
        self._sampler = sampler or ParentBased(ALWAYS_ON)
        self._ids = ids or RandomIdGenerator()

    def begin(self, name: str, headers: Mapping[str, str] = _NO_HEADERS) -> TraceContext:
        """A request's trace context: the caller's trace continued when its headers carry a valid `traceparent`,
        else a new one; kept or dropped by the sampler (a parent-based one follows the caller's flag)."""
        caller = _W3C.extract(headers) if "traceparent" in headers else None
        parent = get_current_span(caller).get_span_context() if caller is not None else None
        if parent is not None and not parent.is_valid:
            parent, caller = None, None
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        sampling = self._sampler.should_sample(caller, trace_id, name, SpanKind.SERVER)
        flags = _SAMPLED if sampling.decision is Decision.RECORD_AND_SAMPLE else _UNSAMPLED
        own = SpanContext(trace_id, self._ids.generate_span_id(), is_remote=False, trace_flags=flags,
                          trace_state=sampling.trace_state)
        return TraceContext(own, parent)

    def child(self, parent: TraceContext) -> TraceContext:
        """A new span's place under `parent` (in its trace, sampled as it is)."""
        up = parent.span
        own = SpanContext(up.trace_id, self._ids.generate_span_id(), is_remote=False, trace_flags=up.trace_flags,
                          trace_state=up.trace_state)
        return TraceContext(own, up)

    def record(self, name: str, start_ns: int, attributes: Mapping[str, Any], error: str | None = None,
               trace: TraceContext | None = None, *, end_ns: int | None = None, events: Sequence[SpanEvent] = (),
               kind: SpanKind = SpanKind.SERVER) -> None:
        """A finished span, in the trace `begin` placed it in (a new trace when None), from start_ns to end_ns
        (ns since the epoch; now when None); the attributes mapping must not change after this."""
        trace = trace or self.begin(name)
        if not trace.sampled:
            return
        end_ns = end_ns or time.time_ns()
        status = _OK if error is None else Status(StatusCode.ERROR, error)
        span = ReadableSpan(name, trace.span, trace.parent, self._resource, attributes, kind=kind,
                            status=status, start_time=start_ns, end_time=end_ns,
                            events=[Event(event, attrs, at_ns) for at_ns, event, attrs in events],
                            instrumentation_scope=self._scope)
        self.processor.on_end(span)

    async def start(self) -> None:
        """Start the export process, when spans go through one. Where no process can be started (a sandbox that
        forbids it), the SDK's processor and exporter run in this process instead, as they would with `console`."""
        if isinstance(self.processor, ExportProcess) and not await self.processor.start():
            log.warning("spans are exported from the serving process: its export process could not start")
            await self.processor.close()
            self.processor = otlp_processor(_DEFAULT_BATCH)

    async def close(self) -> None:
        """Export what is still queued, then stop (the SDK's processor flushes synchronously)."""
        if isinstance(self.processor, ExportProcess):
            await self.processor.close()
        elif isinstance(self.processor, SpanProcessor):
            await asyncio.to_thread(self.processor.shutdown)


class HashedOnce(Resource):
    """A resource whose hash is computed once. The SDK's OTLP encoder files every span of a batch under its
    resource, and a Resource hashes by dumping its attributes as JSON each time it is asked: once a span, the
    same answer for the process's one resource, in the export thread that holds the interpreter. A resource
    never changes after it is made (its attributes are immutable), so its hash does not either."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class CountingExporter(SpanExporter):
    """An exporter that counts the spans it exported and those it could not (called in the processor's thread)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except Exception:  # an exporter's bug must not end the processor's thread: counted as a failure
            log.exception("the span exporter failed")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class BoundedBatches(BatchSpanProcessor):
    """The SDK's batch processor, which drops and counts a new span while as many as its queue holds are not yet
    exported (the SDK's own full queue would silently push out its oldest span, logging each one)."""

    def __init__(self, exporter: SpanExporter, max_queue: int, batch_size: int | None = None) -> None:
        self.counts = CountingExporter(exporter)
        super().__init__(self.counts, max_queue_size=max_queue, max_export_batch_size=batch_size)
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.handed = 0  # only the event loop writes this, only the export thread the counts: no lock needed
        self.refused = 0

    def on_end(self, span: ReadableSpan) -> None:
        if self.handed - self.counts.exported - self.counts.failed >= self.max_queue:
            self.refused += 1
            return
        self.handed += 1
        super().on_end(span)

    @property
    def exported(self) -> int:
        return self.counts.exported

    @property
    def dropped(self) -> int:
        """Spans that never reached the collector: the queue was full, or the export failed."""
        return self.refused + self.counts.failed


def make_spans(exporter_name: str, export_nice: int = DEFAULT_NICE) -> Spans | None:
    """`none`: no spans; `console` prints them; `otlp` (or its old name `otlp-protobuf`) posts them as OTLP/HTTP
    protobuf to OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces), from a process
    of its own (`export_process`: the encoding would hold the serving process's interpreter), export_nice lower in
    priority. The SDK reads its own variables: OTEL_EXPORTER_OTLP_*, OTEL_BSP_* (batching), OTEL_TRACES_SAMPLER and
    _ARG (sampling, parent-based always-on when unset), OTEL_RESOURCE_ATTRIBUTES. Call `start()` in the event loop
    before the first span."""
    processor: SpanSink
    if exporter_name == "console":
        processor = BoundedBatches(ConsoleSpanExporter(), *_queue_and_batch())
    elif exporter_name in ("otlp", "otlp-protobuf"):
        processor = ExportProcess(_queue_and_batch()[0], nice=export_nice)
    else:
        return None
    provider = _provider()
    return Spans(processor, provider.resource, provider.sampler, provider.id_generator)


def otlp_processor(batch: int = _SDK_BATCH) -> BoundedBatches:
    """The SDK's batch processor and OTLP/HTTP exporter. The export process runs them in batches of the SDK's own
    default size (its encoding holds no serving process's interpreter; smaller batches keep the process smaller);
    in the serving process they take the larger batches of `_DEFAULT_BATCH`."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return BoundedBatches(OTLPSpanExporter(), *_queue_and_batch(batch))


def resource() -> Resource:
    """What every span of this gateway names as its resource (with OTEL_RESOURCE_ATTRIBUTES merged in)."""
    return HashedOnce(Resource.create({"service.name": "agent-gateway", "service.version": __version__}))


def _provider() -> TracerProvider:
    """The SDK's provider, for its sampler and id generator."""
    return TracerProvider(shutdown_on_exit=False, resource=resource())


def _queue_and_batch(batch: int = _DEFAULT_BATCH) -> tuple[int, int]:
    max_queue = _positive_env("OTEL_BSP_MAX_QUEUE_SIZE", _DEFAULT_MAX_QUEUE)
    return max_queue, min(_positive_env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", batch), max_queue)


def _positive_env(name: str, default: int) -> int:
    """An OTEL_BSP_* size as the SDK reads it; read here too, so the gateway's bound is the SDK's queue's."""
    raw = os.environ.get(name, "").strip()
    try:
        size = int(raw) if raw else default
    except ValueError:
        size = 0
    if size <= 0:
        log.warning("%s=%r is not a positive whole number; using %d", name, raw, default)
        return default
    return size
