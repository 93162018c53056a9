"""A request span as OTLP JSON text in C (gateway/telemetry/_otlp_text.c)."""

from collections.abc import Callable, Mapping
from typing import Any

def attributes_json(attributes: Mapping[str, Any], encoder: Callable[[str], str], /) -> str | None:
    """otlp._python_attributes_json(attributes), or None for a mapping or value type only it writes."""

def span_text(
    trace_id: int, span_id: int, name: str, kind: int, start_ns: int, end_ns: int, attributes: Mapping[str, Any],
    parent_span_id: int | None, error: str | None, encoder: Callable[[str], str], /,
) -> str | None:
    """otlp._python_span_text of a span without events (kind is OTLP's number), or None where only it writes it."""
