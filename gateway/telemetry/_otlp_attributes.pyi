"""A span's attributes as OTLP JSON text in C (gateway/telemetry/_otlp_attributes.c)."""

from collections.abc import Callable, Mapping
from typing import Any

def attributes_json(attributes: Mapping[str, Any], encoder: Callable[[str], str], /) -> str | None:
    """otlp._python_attributes_json(attributes), or None for a mapping or value type only it writes."""
