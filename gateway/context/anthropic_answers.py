"""What the client gets back of the gateway's context management, as Anthropic answers: `context_management.
applied_edits` on the message (streamed: on its final `message_delta`), the `compaction` block first (pure)."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.apis import events
from gateway.apis.chat import wire as chat_wire
from gateway.apis.messages.wire import MessagesReader
from gateway.apis.usage import Usage
from gateway.context import anthropic_compaction as compaction
from gateway.context.anthropic_edits import Managed

_BLOCK_EVENTS = (b"content_block_start", b"content_block_delta", b"content_block_stop")


def answer(found: dict[str, Any], managed: Managed) -> dict[str, Any]:
    """A non-streamed message with what was done to its prompt: the edits applied, this call's compaction."""
    out = {**found, "context_management": {"applied_edits": managed.reported_edits()}}
    if managed.summary is not None:
        content = found.get("content")
        out["content"] = [compaction.block(managed.summary), *(content if isinstance(content, list) else [])]
    return out


class EditedMessagesReader(MessagesReader):
    """A Messages stream as relayed for a call whose context the gateway edited: the compaction block goes first
    (the deployment's blocks each one index later) and the final `message_delta` names the edits applied."""

    __slots__ = ("_managed",)

    def __init__(self, managed: Managed) -> None:
        super().__init__()
        self._managed = managed

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)
        if not out:
            return out
        whole, rest = chat_wire.split_events(out)  # whole events, but for an over-long one passed on in pieces
        return b"".join(self._rewrite(event) for event in whole) + rest

    def _rewrite(self, event: bytes) -> bytes:
        kind = events.event_type(event)
        summary = self._managed.summary
        if kind == b"message_start" and summary is not None:
            return event + compaction_events(summary, 0)
        if kind in _BLOCK_EVENTS and summary is not None:
            data = events.data_of(event)
            if isinstance(data.get("index"), int):
                return events.sse(kind.decode(), {**data, "index": data["index"] + 1})
        if kind == b"message_delta":
            data = events.data_of(event)
            return events.sse("message_delta", {**data, "context_management": {
                "applied_edits": self._managed.reported_edits()}})
        return event


def compaction_events(summary: str, index: int) -> bytes:
    """The compaction block as Anthropic streams it: opened, its whole summary in one delta, closed."""
    return (events.sse("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": compaction.BLOCK, "content": None}})
            + events.sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": {"type": "compaction_delta", "content": summary}})
            + events.sse("content_block_stop", {"type": "content_block_stop", "index": index}))


def paused(managed: Managed, model: str, usage: Usage) -> dict[str, Any]:
    """The answer of pause_after_compaction: the compaction block alone, stop_reason "compaction"."""
    assert managed.summary is not None
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": [compaction.block(managed.summary)], "stop_reason": "compaction", "stop_sequence": None,
            "usage": messages_usage(usage),
            "context_management": {"applied_edits": managed.reported_edits()}}


def messages_usage(usage: Usage) -> dict[str, int]:
    """A usage as Anthropic counts it: input_tokens is the prompt less what was read from the prefix cache."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def paused_stream(message: dict[str, Any]) -> bytes:
    """`paused`'s answer as a stream of Anthropic's events."""
    start = {**message, "content": [], "stop_reason": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    start.pop("context_management")
    return (events.sse("message_start", {"type": "message_start", "message": start})
            + compaction_events(message["content"][0]["content"], 0)
            + events.sse("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": "compaction", "stop_sequence": None},
                                           "usage": message["usage"],
                                           "context_management": message["context_management"]})
            + events.sse("message_stop", {"type": "message_stop"}))
