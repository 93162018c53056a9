"""One OpenTelemetry span per request, recorded finished, and an OTLP/HTTP JSON exporter for them.

Why not `tracer.start_span(...)` and `span.end()`: the SDK's live-span path (context, sampler, locks,
attribute validation) costs ~40 µs per span on the machine this gateway is measured on, and the SDK's
OTLP protobuf encoder another ~100 µs per span in the export thread, which holds the GIL. A request's
span is only ever created once it is over, with every attribute known and of a valid type, so it is
built directly as the SDK's ReadableSpan (a few µs) and handed to a standard BatchSpanProcessor; the
default exporter writes OTLP's JSON encoding as text, from cached per-attribute fragments.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _json_str  # C-accelerated; valid JSON text
from typing import Any
from urllib.parse import unquote

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway import __version__

log = logging.getLogger(__name__)

DEFAULT_OTLP_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)


class Spans:
    """Records finished request spans into a span processor (which batches and exports them)."""

    def __init__(self, processor: SpanProcessor, resource: Resource | None = None,
                 sampler: Sampler | None = None) -> None:
        self._processor = processor
        self._resource = resource or Resource.create({"service.name": "agent-gateway"})
        self._scope = InstrumentationScope("agent-gateway", __version__)
        self._sampler = sampler  # None: every span is kept (OTEL_TRACES_SAMPLER unset)
        self._ids = random.Random()

    def record(self, name: str, start_ns: int, attributes: Mapping[str, Any], error: str | None = None) -> None:
        trace_id = self._ids.getrandbits(128) or 1  # zero is the invalid id
        if self._sampler is not None and not self._sampler.should_sample(None, trace_id, name).decision.is_sampled():
            return
        context = SpanContext(trace_id, self._ids.getrandbits(64) or 1, is_remote=False, trace_flags=_SAMPLED)
        status = _OK if error is None else Status(StatusCode.ERROR, error)
        span = ReadableSpan(name, context, None, self._resource, attributes, kind=SpanKind.SERVER, status=status,
                            start_time=start_ns, end_time=time.time_ns(), instrumentation_scope=self._scope)
        self._processor.on_end(span)

    def shutdown(self) -> None:
        self._processor.shutdown()


def make_spans(exporter_name: str) -> Spans | None:
    """`none`: no spans; `console` prints them; `otlp` (JSON) and `otlp-protobuf` read OTEL_EXPORTER_OTLP_*."""
    exporter = _exporter(exporter_name)
    if exporter is None:
        return None
    # The SDK's provider reads OTEL_RESOURCE_ATTRIBUTES and OTEL_TRACES_SAMPLER* as usual.
    provider = TracerProvider(resource=Resource.create({"service.name": "agent-gateway",
                                                        "service.version": __version__}))
    sampler = provider.sampler if os.environ.get("OTEL_TRACES_SAMPLER") else None
    return Spans(BatchSpanProcessor(exporter), provider.resource, sampler)


def _exporter(name: str) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        return OtlpJsonExporter.from_env()
    if name == "otlp-protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("traces=otlp-protobuf needs opentelemetry-exporter-otlp-proto-http; not exporting spans")
            return None
        return OTLPSpanExporter(endpoint=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    return None


class OtlpJsonExporter(SpanExporter):
    """OTLP/HTTP with the JSON encoding (spec'd by OTLP; accepted by the Collector, Tempo, Jaeger...)."""

    def __init__(self, endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self._headers = {"content-type": "application/json", **(headers or {})}
        self._timeout_s = timeout_s

    @classmethod
    def from_env(cls) -> OtlpJsonExporter:
        """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces; *_HEADERS k=v,..."""
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        raw = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")
        pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
        headers = {unquote(k.strip()): unquote(v.strip()) for k, v in pairs}
        return cls(endpoint or DEFAULT_OTLP_TRACES_ENDPOINT, headers)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        request = urllib.request.Request(self.endpoint, data=otlp_json(spans), headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                reply.read()
        except (OSError, urllib.error.URLError) as exc:
            # The endpoint only: the headers may carry a collector's API key.
            log.warning("could not export %d spans to %s: %s", len(spans), self.endpoint, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def otlp_json(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest in OTLP's JSON encoding, spans grouped by resource and scope.

    Written as text from cached fragments rather than via dicts and json.dumps: a request span's
    attributes mostly repeat (operation, models, rule, reasons, deployment), and this runs in the export
    thread, which holds the GIL the request path needs.
    """
    groups: dict[tuple[int, int], tuple[ReadableSpan, list[str]]] = {}
    for span in spans:
        key = (id(span.resource), id(span.instrumentation_scope))
        groups.setdefault(key, (span, []))[1].append(_span_json(span))
    resource_spans = []
    for first, encoded in groups.values():
        scope = first.instrumentation_scope
        scope_json = json.dumps({"name": scope.name, "version": scope.version or ""} if scope else {"name": ""})
        resource_spans.append(f'{{"resource":{{"attributes":{_attributes_json(first.resource.attributes)}}},'
                              f'"scopeSpans":[{{"scope":{scope_json},"spans":[{",".join(encoded)}]}}]}}')
    return f'{{"resourceSpans":[{",".join(resource_spans)}]}}'.encode()


def _span_json(span: ReadableSpan) -> str:
    context = span.context
    trace_id, span_id = (context.trace_id, context.span_id) if context else (0, 0)
    # The API's SpanKind starts at INTERNAL=0; OTLP's at UNSPECIFIED=0. Ids are hex in OTLP's JSON.
    out = (f'{{"traceId":"{trace_id:032x}","spanId":"{span_id:016x}","name":{_json_str(span.name)},'
           f'"kind":{span.kind.value + 1},"startTimeUnixNano":"{span.start_time or 0}",'
           f'"endTimeUnixNano":"{span.end_time or 0}","attributes":{_attributes_json(span.attributes or {})}')
    if span.parent is not None:
        out += f',"parentSpanId":"{span.parent.span_id:016x}"'
    if span.status.status_code is StatusCode.ERROR:
        out += f',"status":{{"code":2,"message":{_json_str(span.status.description or "")}}}'
    return out + "}"


def _attributes_json(attributes: Mapping[str, Any]) -> str:
    return "[" + ",".join(_attribute_json(key, value) for key, value in attributes.items()) + "]"


_FRAGMENTS: dict[tuple[str, Any], str] = {}
_FRAGMENTS_MAX = 4096  # request ids and timings never repeat: start over rather than grow without bound


def _attribute_json(key: str, value: Any) -> str:
    cache_key = (key, tuple(value) if isinstance(value, list) else value)
    fragment = _FRAGMENTS.get(cache_key)
    if fragment is None:
        fragment = f'{{"key":{_json_str(key)},"value":{_value_json(value)}}}'
        if len(_FRAGMENTS) >= _FRAGMENTS_MAX:
            _FRAGMENTS.clear()
        _FRAGMENTS[cache_key] = fragment
    return fragment


def _value_json(value: Any) -> str:
    if isinstance(value, bool):
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if isinstance(value, int):
        return f'{{"intValue":"{value}"}}'  # int64 is a string in protobuf's JSON mapping
    if isinstance(value, float):
        number = repr(value) if math.isfinite(value) else _NON_FINITE[repr(value)]
        return f'{{"doubleValue":{number}}}'
    if isinstance(value, list | tuple):
        return f'{{"arrayValue":{{"values":[{",".join(_value_json(v) for v in value)}]}}}}'
    return f'{{"stringValue":{_json_str(str(value))}}}'


_NON_FINITE = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}
