"""The admin API's query parameters, read one way: a whole number in its range, or a 400 naming the parameter."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gateway.errors import BadRequest

_WHOLE = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit also takes '²', which int() refuses


def whole_number(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """`?name=N` as an int from `low` to `high` (`default` when absent)."""
    raw = query.get(name)
    if raw is None:
        return default
    if not _WHOLE.fullmatch(raw) or not low <= int(raw) <= high:
        raise BadRequest(f"{name} must be a whole number from {low} to {high}, got {raw[:32]!r}", param=name)
    return int(raw)
