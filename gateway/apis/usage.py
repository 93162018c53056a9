"""What a call used, as every API reports it: prompt (of it cached) and generated tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0  # every prompt token, cached or not
    completion_tokens: int = 0
    estimated: bool = False  # counted by the gateway from a stream that ended without its usage chunk
    cached_tokens: int = 0  # of the prompt, read from the deployment's prefix cache (priced apart)
    cached_overstated: bool = False  # the deployment reported more cached tokens than prompt tokens: clamped
    # the usage carried a cached count (vLLM's --enable-prompt-tokens-details); when not, cached_tokens is 0 for
    # billing, but says nothing of the deployment's cache
    cached_reported: bool = False


def is_token_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_count(value: Any) -> int:
    """A reported token count: a non-negative integer, else 0 (a missing or garbled figure never raises)."""
    return value if is_token_count(value) else 0


def reported_usage(prompt_tokens: Any, completion_tokens: Any, cached_tokens: Any = None) -> Usage:
    """A deployment's usage from its raw figures. Cached tokens are part of the prompt: a count above the
    prompt's is clamped to it and flagged, so no price ever charges a negative number of uncached tokens."""
    prompt, cached = token_count(prompt_tokens), token_count(cached_tokens)
    return Usage(prompt, token_count(completion_tokens), cached_tokens=min(cached, prompt),
                 cached_overstated=cached > prompt, cached_reported=is_token_count(cached_tokens))


def cached_of(details: Any) -> Any:
    """The `cached_tokens` of a usage's details object (`prompt_tokens_details`, `input_tokens_details`)."""
    return details.get("cached_tokens") if isinstance(details, dict) else None
