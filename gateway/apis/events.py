"""What both agent APIs share: bounded reading of their bodies, and a reader of their named SSE events.

Both stream `event: <type>` / `data: <json>` pairs. The reader relays complete events as they arrive and
parses only the few whose type the gateway needs (the first, usage, the terminal ones): every other event
goes through untouched and unparsed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.chat.wire import StreamTally
from gateway.apis.usage import Usage

# A conversation is read by its newest MAX_VIEW_ITEMS items (an agent's long session has a few hundred;
# a hostile body may have 100,000): the decision's cost stays bounded, and the deployment's usage gives
# the exact prompt afterwards.
MAX_VIEW_ITEMS = 1_000
# Parts of one content list (text blocks, tool results of one user turn) read; the rest are not.
MAX_PARTS = 64
# A tool call's input as chat arguments: longer inputs are cut (the view is for reading, never forwarded).
MAX_ARGUMENTS_CHARS = 16_000
# A deployment that sends this much without ending an event is not speaking SSE: its bytes go on unread.
MAX_PENDING_BYTES = 1024 * 1024


def newest(items: list[Any]) -> list[Any]:
    """The newest MAX_VIEW_ITEMS items."""
    return items[-MAX_VIEW_ITEMS:] if len(items) > MAX_VIEW_ITEMS else items


def newest_messages(items: list[Any], convert: Callable[[Any], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The chat messages of the newest items, at most MAX_VIEW_ITEMS (an item may make several): converted
    newest first, so an item with many parts costs no more than the messages it leaves in the view."""
    found: list[dict[str, Any]] = []
    for item in reversed(newest(items)):
        found += reversed(convert(item))
        if len(found) >= MAX_VIEW_ITEMS:
            break
    found.reverse()
    return found[-MAX_VIEW_ITEMS:]


def parts(content: Any) -> list[Any]:
    """A content list's first MAX_PARTS parts ([] for anything else)."""
    if not isinstance(content, list):
        return []
    return content[:MAX_PARTS] if len(content) > MAX_PARTS else content


def content_view(content: Any) -> Any:
    """Content as chat's `content` reads it: a string as is, a list of parts bounded (their `text` is read)."""
    return content if isinstance(content, str) else parts(content)


def arguments_text(value: Any) -> str:
    """A tool call's input as chat's `arguments` string; never raises, however deep or odd the value."""
    if isinstance(value, str):
        return value[:MAX_ARGUMENTS_CHARS]
    try:
        return json_body.encode(value).decode("utf-8", "replace")[:MAX_ARGUMENTS_CHARS]
    except (ValueError, TypeError, RecursionError):  # nested deeper than either encoder goes
        return ""


def function_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    """A chat tool spec; the description and schema are shared, not copied (features count their size)."""
    function: dict[str, Any] = {"name": name if isinstance(name, str) else ""}
    if isinstance(description, str):
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """A chat assistant tool call."""
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": "function",
        "function": {"name": name if isinstance(name, str) else "", "arguments": arguments_text(arguments)},
    }


def answer_view(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An answer as a chat completion: what the agent step reads tool calls from (agents/trajectory.py)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}


def event_type(event: bytes) -> bytes:
    """The `event:` name an SSE event starts with (b"" when it has none)."""
    if not event.startswith(b"event:"):
        return b""
    end = event.find(b"\n")
    return event[6:end].strip()


def data_of(event: bytes) -> dict[str, Any]:
    """An event's JSON object ({} when it has none)."""
    found = chat_wire.event_data(event)
    return found if isinstance(found, dict) else {}


def sse(kind: str, data: Mapping[str, Any]) -> bytes:
    """One named SSE event."""
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class EventReader:
    """Relays a deployment's stream as complete events, reading those whose type is in `READ`.

    Subclasses set READ and `read(kind, event)`; they note `usage` (the deployment's own count), `done` (the
    stream ended as its API ends one), `model` and `error` (the deployment ended it with its own error event).
    """

    READ: frozenset[bytes] = frozenset()
    WITHHOLDS_ERROR = False  # the deployment's error event and what follows it are not relayed (the relay ends it)
    __slots__ = ("_pending", "done", "error", "model", "streamed", "usage")

    def __init__(self, streamed: StreamTally) -> None:
        self._pending = b""
        self.usage: Usage | None = None
        self.done = False
        self.error = False
        self.model: str | None = None
        self.streamed = streamed  # what was generated, should the usage never come

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what has arrived, to send on; an incomplete one waits for its rest."""
        self.streamed.add(chunk)
        if self.error and self.WITHHOLDS_ERROR:
            return b""
        events, self._pending = chat_wire.split_events(self._pending + chunk)
        if len(self._pending) > MAX_PENDING_BYTES:
            events, self._pending = [*events, self._pending], b""
        for i, event in enumerate(events):
            kind = event_type(event)
            if kind in self.READ:
                self.read(kind, event)
                if self.error and self.WITHHOLDS_ERROR:
                    self._pending = b""
                    return b"".join(events[:i])
        return b"".join(events)

    def read(self, kind: bytes, event: bytes) -> None:
        raise NotImplementedError
