"""OTLP's JSON encoding of finished spans, written as text (ExportTraceServiceRequest, OTLP/HTTP)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _json_str  # C-accelerated; valid JSON text
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, StatusCode

from gateway.telemetry.metrics import CLIENT_REQUEST_ID, REQUEST_ID

try:  # the optional C encoder of a request span (setup.py); the Python one below where it did not build
    from gateway.telemetry import _otlp_text as native
except ImportError:
    native = None  # type: ignore[assignment]

SpanEvent = tuple[int, str, Mapping[str, Any]]  # (time in ns since the epoch, name, attributes)


def otlp_json(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest in OTLP's JSON encoding, spans grouped by resource and scope."""
    groups: dict[tuple[int, int], tuple[ReadableSpan, list[str]]] = {}
    for span in spans:
        key = (id(span.resource), id(span.instrumentation_scope))
        groups.setdefault(key, (span, []))[1].append(span_json(span))
    return request_json([resource_spans_json(first.resource, first.instrumentation_scope, encoded)
                         for first, encoded in groups.values()])


def request_json(resource_spans: Sequence[str]) -> bytes:
    return f'{{"resourceSpans":[{",".join(resource_spans)}]}}'.encode()


def resource_spans_json(resource: Resource, scope: InstrumentationScope | None, encoded_spans: Sequence[str]) -> str:
    """One ResourceSpans holding already-encoded spans of that resource and scope."""
    scope_json = json.dumps({"name": scope.name, "version": scope.version or ""} if scope else {"name": ""})
    return (f'{{"resource":{{"attributes":{_attributes_json(resource.attributes)}}},'
            f'"scopeSpans":[{{"scope":{scope_json},"spans":[{",".join(encoded_spans)}]}}]}}')


def span_json(span: ReadableSpan) -> str:
    context = span.context
    return span_text(
        context.trace_id if context else 0, context.span_id if context else 0, span.name, span.kind,
        span.start_time or 0, span.end_time or 0, span.attributes or {},
        span.parent.span_id if span.parent is not None else None,
        (span.status.description or "") if span.status.status_code is StatusCode.ERROR else None,
    )


def span_text(trace_id: int, span_id: int, name: str, kind: SpanKind, start_ns: int, end_ns: int,
              attributes: Mapping[str, Any], parent_span_id: int | None = None, error: str | None = None,
              events: Sequence[SpanEvent] = ()) -> str:
    """One span as OTLP JSON text: by the C encoder where it built and takes the span, else in Python."""
    if native is not None and not events:
        # The API's SpanKind starts at INTERNAL=0; OTLP's at UNSPECIFIED=0 (`_value_`: `value` is a property call).
        encoded = native.span_text(trace_id, span_id, name, kind._value_ + 1, start_ns, end_ns, attributes,
                                   parent_span_id, error, _json_str)
        if encoded is not None:
            return encoded
    return _python_span_text(trace_id, span_id, name, kind, start_ns, end_ns, attributes, parent_span_id, error,
                             events)


def _python_span_text(trace_id: int, span_id: int, name: str, kind: SpanKind, start_ns: int, end_ns: int,
                      attributes: Mapping[str, Any], parent_span_id: int | None = None, error: str | None = None,
                      events: Sequence[SpanEvent] = ()) -> str:
    """One span, as text built from cached fragments rather than dicts and json.dumps: a request span's
    attributes mostly repeat (operation, models, rule, reasons, deployment). The C encoder's reference."""
    # The API's SpanKind starts at INTERNAL=0; OTLP's at UNSPECIFIED=0. Ids are hex in OTLP's JSON.
    out = (f'{{"traceId":"{trace_id:032x}","spanId":"{span_id:016x}","name":{_json_str(name)},'
           f'"kind":{kind.value + 1},"startTimeUnixNano":"{start_ns}","endTimeUnixNano":"{end_ns}",'
           f'"attributes":{_attributes_json(attributes)}')
    if parent_span_id is not None:
        out += f',"parentSpanId":"{parent_span_id:016x}"'
    if error is not None:
        out += f',"status":{{"code":2,"message":{_json_str(error)}}}'
    if events:
        out += ',"events":[' + ",".join(
            f'{{"timeUnixNano":"{at_ns}","name":{_json_str(event)},"attributes":{_attributes_json(attrs)}}}'
            for at_ns, event, attrs in events) + "]"
    return out + "}"


def _attributes_json(attributes: Mapping[str, Any]) -> str:
    if native is not None:
        encoded = native.attributes_json(attributes, _json_str)
        if encoded is not None:
            return encoded
    return _python_attributes_json(attributes)


def _python_attributes_json(attributes: Mapping[str, Any]) -> str:
    """The encoder of any attributes: the C one's reference, and the path for what it leaves (a resource's
    BoundedAttributes, a subclass or an unusual type)."""
    parts = []
    for item in attributes.items():
        value = item[1]
        cls = value.__class__
        if cls is str or cls is tuple:
            parts.append(_FRAGMENTS.get(item) or _attribute_json(item))
        elif cls is int:  # numbers rarely repeat: encoded each time after the key's cached prefix
            parts.append(f'{_KEYS.get(item[0]) or _key_json(item[0])}{{"intValue":"{value}"}}}}')
        else:
            parts.append(f"{_KEYS.get(item[0]) or _key_json(item[0])}{_value_json(value)}}}")
    return "[" + ",".join(parts) + "]"


# `{"key":<key>,"value":` of each attribute key seen
_KEYS: dict[str, str] = {}


def _key_json(key: str) -> str:
    if len(_KEYS) >= _FRAGMENTS_MAX:
        _KEYS.clear()
    _KEYS[key] = encoded = f'{{"key":{_json_str(key)},"value":'
    return encoded


# Fragments of string and string-tuple attributes, keyed by the (key, value) item itself. Numbers are
# not: they rarely repeat, and 1, 1.0 and True are equal keys that must encode differently.
_FRAGMENTS: dict[tuple[str, Any], str] = {}
_FRAGMENTS_MAX = 4096  # start over rather than grow without bound
# Values unique to their span: encoded, never kept (they would crowd out what repeats, and empty the cache)
_UNIQUE_KEYS = frozenset({REQUEST_ID, CLIENT_REQUEST_ID})


def _attribute_json(item: tuple[str, Any]) -> str:
    key, value = item
    fragment = f"{_KEYS.get(key) or _key_json(key)}{_value_json(value)}}}"
    if key in _UNIQUE_KEYS:
        return fragment
    if value.__class__ is str or (value.__class__ is tuple and all(v.__class__ is str for v in value)):
        if len(_FRAGMENTS) >= _FRAGMENTS_MAX:
            _FRAGMENTS.clear()
        _FRAGMENTS[item] = fragment
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
