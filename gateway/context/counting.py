"""The one token count context management decides by (triggers, `clear_at_least`, what an edit cleared).

Every count of an edit goes through `text_tokens`: when windows are counted in the deployment's own tokens, this
is the one function to swap. Until then it is the gateway's cl100k count, exact for texts that recur (memoized)
and estimated for very long ones, so that a 100k-token conversation costs dictionary lookups, not a re-encoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.features import EXACT_CHARS_PER_MESSAGE, count_exact, estimate_tokens

Count = Callable[[str], int]


def text_tokens(text: str) -> int:
    """Tokens of one text of a prompt."""
    if not text:
        return 0
    return count_exact(text) if len(text) <= EXACT_CHARS_PER_MESSAGE else estimate_tokens(text)


def value_text(value: Any) -> str:
    """What the model reads of a block's value: a string as it is, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def content_tokens(content: Any, count: Count = text_tokens) -> int:
    """Tokens of a Messages content: a string, or blocks (each as `block_tokens`)."""
    if isinstance(content, str):
        return count(content)
    if isinstance(content, list):
        return sum(block_tokens(block, count) for block in content)
    return 0


def block_tokens(block: Any, count: Count = text_tokens) -> int:
    """Tokens of one Messages content block: its text, thinking, tool input or tool result content."""
    if not isinstance(block, Mapping):
        return count(value_text(block))
    kind = block.get("type")
    if kind == "text":
        return count(value_text(block.get("text")))
    if kind == "thinking":
        return count(value_text(block.get("thinking")))
    if kind == "redacted_thinking":
        return estimate_tokens(value_text(block.get("data")))
    if kind in ("tool_use", "server_tool_use"):
        return count(value_text(block.get("name"))) + count(value_text(block.get("input")))
    if kind == "tool_result":
        return content_tokens(block.get("content"), count)
    if kind == "compaction":
        return count(value_text(block.get("content")))
    if kind in ("image", "document"):
        return 0  # media are not counted by the gateway's text count (features.py does the same)
    return count(value_text({k: v for k, v in block.items() if k != "cache_control"}))


def input_tokens(body: Mapping[str, Any], count: Count = text_tokens) -> int:
    """Tokens of a Messages request's prompt: system, every message, the tool definitions."""
    total = content_tokens(body.get("system"), count)
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, Mapping):
            total += content_tokens(message.get("content"), count)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        total += count(value_text(tools))
    return total
