"""A classifier's structured terms summed in C (gateway/classifier/_terms.c), rows from inputs.py's Sources."""

from typing import Any

class Terms:
    """Rows (reads the cues, attribute, op code, argument, mean, slope, low, high), summed in their order."""

    def __new__(cls, rows: tuple[tuple[bool, str, int, Any, float, float, float, float], ...], /) -> Terms: ...
    def add(self, features: Any, cues: Any, z: float, /) -> float:
        """z plus every term's slope * (clamp(value, low, high) - mean): the float inputs.py's Python sum gives."""
