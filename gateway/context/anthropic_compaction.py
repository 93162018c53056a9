"""Anthropic's compaction (compact_20260112) done by the gateway: the summary's request and prompt, a conversation
replaced by its summary, and the `compaction` block the answer carries back (pure).

The summary comes from the deployment itself, through its chat completions endpoint, with one fixed anchored
prompt (`summary_request`); the client sends the compaction block back in the assistant turn it came with, and
every later request reads as [the summary, what followed it]: the prefix the deployment has cached stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.context.counting import value_text

BLOCK = "compaction"
# How a summary reads to the model in place of the conversation it replaced.
SUMMARY_LEAD = "This conversation continues from an earlier part that was compacted. Its summary:\n\n"
# The anchored summary: fixed sections, so that a summary of a summary keeps what the first one kept.
SUMMARY_PROMPT = (
    "You summarize a conversation between a user and an AI assistant (with its tool calls and their results) so "
    "that the assistant can continue the work from the summary alone. Write these sections, in this order:\n"
    "## Task\nWhat the user asked for, with every requirement and constraint they stated.\n"
    "## Done so far\nWhat was done and found: files, commands, decisions, and the results that matter.\n"
    "## Current state\nWhere the work stands at the end of the conversation, and any error still open.\n"
    "## Next steps\nWhat remains to be done, in order; the user's latest request first.\n"
    "Keep names, paths, identifiers and numbers exactly. Write only the summary."
)
SUMMARY_MAX_TOKENS = 4096
TRANSCRIPT_RESULT_CHARS = 4_000  # a tool result's text beyond this is cut in the transcript the summary reads


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
    lead = {"type": "text", "text": SUMMARY_LEAD + summary}
    if rest and _role(rest[0]) == "user":
        content = rest[0].get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(_blocks(rest[0]))
        return [{**rest[0], "content": [lead, *blocks]}, *rest[1:]]
    return [{"role": "user", "content": [lead]}, *rest]


def summary_request(body: Mapping[str, Any], instructions: str | None, served_model: str) -> dict[str, Any]:
    """The chat completion that summarizes a Messages conversation (`instructions` replace the default prompt)."""
    return {"model": served_model, "max_tokens": SUMMARY_MAX_TOKENS, "temperature": 0, "stream": False,
            "messages": [{"role": "system", "content": instructions or SUMMARY_PROMPT},
                         {"role": "user", "content": transcript(body)}]}


def summary_of(answer: Mapping[str, Any]) -> str | None:
    """The summary text of the chat completion that wrote it (None: it wrote none)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    message = choices[0].get("message")
    text = message.get("content") if isinstance(message, Mapping) else None
    return text.strip() if isinstance(text, str) and text.strip() else None


def transcript(body: Mapping[str, Any]) -> str:
    """The conversation as the text the summary reads: the system prompt, then each turn's text, tool calls and
    tool results (thinking is left out: it is the model's own working, not the conversation)."""
    lines = []
    system = body.get("system")
    if system:
        lines.append("[system]\n" + _text(system))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, Mapping):
            lines.append(f"[{message.get('role')}]\n" + _text(message.get("content")))
    return "\n\n".join(lines) + "\n\nSummarize the conversation above."


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(value_text(block.get("text")))
        elif kind == "tool_use":
            parts.append(f"(tool call {block.get('name')}: {value_text(block.get('input'))})")
        elif kind == "tool_result":
            result = _text(block.get("content"))[:TRANSCRIPT_RESULT_CHARS]
            parts.append(f"(tool result{' (error)' if block.get('is_error') else ''}: {result})")
    return "\n".join(parts)


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
