"""Chat Completions, Completions and Embeddings: the OpenAI APIs whose bodies the decision reads as they are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.recurring import Recurring
from gateway.apis.usage import Usage
from gateway.context import eviction, retrieval, tool_outputs
from gateway.context.anthropic_edits import Managed
from gateway.errors import GatewayError
from gateway.features import Features, extract


class OpenAIAdapter:
    """One of the three OpenAI APIs vLLM serves under their own names; the decision reads their bodies as sent."""

    __slots__ = ("assistant_texts", "block", "endpoint", "generates", "operation", "path", "resumable",
                 "tool_outputs", "turns")
    chains, step_from_chunks = False, True

    def __init__(self, endpoint: str) -> None:
        self.generates = self.resumable = endpoint != "embeddings"
        self.endpoint = endpoint
        self.path = chat_wire.PATHS[endpoint]
        self.operation = chat_wire.OPERATION[endpoint]
        self.tool_outputs: tool_outputs.ToolOutputs | None = tool_outputs.CHAT if endpoint == "chat" else None
        self.turns: eviction.TurnShape | None = eviction.CHAT if endpoint == "chat" else None
        self.block: retrieval.BlockShape | None = retrieval.CHAT if endpoint == "chat" else None
        chat = endpoint == "chat"
        self.assistant_texts: tool_outputs.ToolOutputs | None = tool_outputs.CHAT_ASSISTANT if chat else None

    def parse(self, raw: bytes, recurring: Recurring | None = None) -> json_body.Source:
        sent = json_body.read(raw, "messages" if self.endpoint == "chat" else None, recurring)
        chat_wire.check(sent.body, self.endpoint, sent.conversation)
        return sent

    def manage_context(self, body: dict[str, Any]) -> tuple[dict[str, Any], Managed | None]:
        return body, None

    def view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return body

    def features(self, view: Mapping[str, Any], sent: json_body.Source | None = None) -> Features:
        if sent is None:
            return extract(view, self.endpoint)
        return extract(view, self.endpoint, sent.member_as_sent("tools", view.get("tools")), sent.conversation)

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: json_body.Source | None = None) -> tuple[bytes, bool]:
        return chat_wire.upstream_body(body, served_model, cap_tokens, endpoint=self.endpoint, source=source)

    def usage_of(self, answer: Mapping[str, Any]) -> Usage | None:
        return chat_wire.usage_of(answer)

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        return raw, found

    def answer_view(self, found: Mapping[str, Any]) -> dict[str, Any] | None:
        return None

    def stream_reader(self, client_wants_usage: bool, answer_id: str, managed: Managed | None = None) -> SseReader:
        return SseReader(client_wants_usage)

    def new_id(self) -> str:
        return ""

    def envelope(self, err: GatewayError) -> dict[str, Any]:
        return err.envelope()

    def error_answer(self, status: int, raw: bytes, found: dict[str, Any]) -> bytes:
        return raw  # vLLM's own, in OpenAI's envelope


class SseReader:
    """Splits an OpenAI stream into SSE events, takes the usage chunk, notes [DONE]."""

    __slots__ = ("_pending", "client_wants_usage", "done", "streamed", "usage")
    error = False  # a deployment's error chunk is found by the relay itself (resume.before_error)

    def __init__(self, client_wants_usage: bool) -> None:
        self.client_wants_usage = client_wants_usage
        self._pending = b""
        self.usage: Usage | None = None
        self.done = False
        self.streamed = chat_wire.StreamTally()  # what was generated, should the usage chunk never come

    def feed(self, chunk: bytes) -> bytes:
        self.streamed.add(chunk)
        # Nearly every chunk is whole content events: pass those through without splitting them.
        if not self._pending and chunk.endswith(b"\n\n") and b'"usage"' not in chunk and b"[DONE]" not in chunk:
            return chunk
        events, self._pending = chat_wire.split_events(self._pending + chunk)
        if not events:
            return b""
        kept = []
        for event in events:
            if chat_wire.is_usage_event(event):
                self.usage = chat_wire.usage_of(chat_wire.event_data(event))
                if not self.client_wants_usage:
                    continue
            elif event.startswith(chat_wire.DONE_EVENT):
                self.done = True
            kept.append(event)
        return b"".join(kept)

    def error_event(self, err: GatewayError) -> bytes:
        return chat_wire.error_event(err)

    def answer_view(self) -> dict[str, Any] | None:
        return None


CHAT = OpenAIAdapter("chat")
COMPLETIONS = OpenAIAdapter("completions")
EMBEDDINGS = OpenAIAdapter("embeddings")
