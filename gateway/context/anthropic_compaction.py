"""Anthropic's compaction (compact_20260112) done by the gateway, the part that is Anthropic's own: a conversation
replaced by its summary, the `compaction` block the answer carries back, and that block taken back in (pure).

The summary itself is the gateway's one summarizer's (gateway/context/summaries.py: one anchored prompt and its
parser for every API, or the request's `instructions`), written through gateway/server/compaction.py. The client
sends the compaction block back in the assistant turn it came with, and every later request reads as [the
summary, what followed it]: the prefix the deployment has cached stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.context.summaries import summary_message_text

BLOCK = "compaction"


def take_in(messages: list[Any]) -> tuple[list[Any], str | None]:
    """The messages as the deployment reads them after a compaction the client sent back: everything before
    the newest compaction block gives way to its summary (a block with no summary is dropped: a no-op)."""
    found, any_block = None, False
    # One plain pass (dicts, as JSON decodes them): it runs on each of Claude Code's turns, most without a block.
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and message.get("role") == "assistant":
            for j, block in enumerate(content):
                if isinstance(block, dict) and block.get("type") == BLOCK:
                    any_block = True
                    found = (i, j) if isinstance(block.get("content"), str) else found
    if found is None:
        return (_without_empty_blocks(messages) if any_block else messages), None
    i, j = found
    summary: str = messages[i]["content"][j]["content"]
    after = [b for b in _blocks(messages[i])[j + 1:] if not _is_block(b)]
    rest = ([{**messages[i], "content": after}] if after else []) + _without_empty_blocks(messages[i + 1:])
    return with_summary(summary, rest), summary


def with_summary(summary: str, rest: list[Any]) -> list[Any]:
    """The conversation as [the summary, what followed it]: the summary opens the first user turn."""
    lead = {"type": "text", "text": summary_message_text(summary)}
    if rest and _role(rest[0]) == "user":
        content = rest[0].get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(_blocks(rest[0]))
        return [{**rest[0], "content": [lead, *blocks]}, *rest[1:]]
    return [{"role": "user", "content": [lead]}, *rest]


def compacted_body(body: Mapping[str, Any], summary: str) -> dict[str, Any]:
    """The request the deployment answers once the conversation is compacted: the summary alone, as the
    client's next request will read up to this answer."""
    return {**body, "messages": with_summary(summary, [])}


def block(summary: str) -> dict[str, Any]:
    return {"type": BLOCK, "content": summary}


def _without_empty_blocks(messages: list[Any]) -> list[Any]:
    """Compaction blocks with no summary are no-ops: the deployment never sees them."""
    out = []
    for message in messages:
        blocks = _blocks(message)
        if _role(message) == "assistant" and any(_is_block(b) for b in blocks):
            message = {**message, "content": [b for b in blocks if not _is_block(b)]}
        out.append(message)
    return out


def _is_block(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") == BLOCK


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, Mapping) else None
    return content if isinstance(content, list) else []
