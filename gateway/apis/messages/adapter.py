"""Anthropic's Messages API (Claude Code) as the gateway serves it: `POST /v1/messages` and
`/v1/messages/count_tokens`, with Anthropic's `context_management` done by the gateway, for vLLM ignores it.

The decision reads a request through its chat-shaped view (wire.view); what reaches the deployment and the client
is the API's own body and events, forwarded to the deployment's own /v1/messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.apis import json_body
from gateway.apis.adapter import features_as_chat
from gateway.apis.messages import wire as messages
from gateway.apis.recurring import Recurring
from gateway.apis.usage import Usage
from gateway.context import anthropic_answers, eviction, retrieval, tool_outputs
from gateway.context.anthropic_config import FIELD, read_edits
from gateway.context.anthropic_edits import Managed, manage
from gateway.context.tool_outputs import MESSAGES_ASSISTANT, ToolOutputs
from gateway.errors import GatewayError
from gateway.features import Features


class MessagesAdapter:
    """`POST /v1/messages` (and, with `counting`, `/v1/messages/count_tokens`, which generates nothing)."""

    # resumable: vLLM's /v1/messages cannot continue a partial message
    operation, chains, resumable, step_from_chunks = "chat", False, False, False
    tool_outputs: tool_outputs.ToolOutputs | None = tool_outputs.MESSAGES
    turns: eviction.TurnShape | None = eviction.MESSAGES
    block: retrieval.BlockShape | None = retrieval.MESSAGES
    assistant_texts: ToolOutputs | None = MESSAGES_ASSISTANT

    def __init__(self, counting: bool = False) -> None:
        self.counting = counting
        self.generates = not counting
        self.endpoint = "messages_count_tokens" if counting else "messages"
        self.path = messages.COUNT_TOKENS_PATH if counting else messages.PATH

    def parse(self, raw: bytes, recurring: Recurring | None = None) -> json_body.Source:
        sent = json_body.read(raw, "messages", recurring)
        messages.check(sent.body, count_tokens=self.counting)
        return sent

    def manage_context(self, body: dict[str, Any]) -> tuple[dict[str, Any], Managed | None]:
        """Anthropic's `context_management` done here, for vLLM ignores it: the edits made to the body, the field
        taken out (count_tokens counts the edited prompt; it never compacts)."""
        if FIELD not in body:
            return body, None
        managed = manage(body, read_edits(body))
        if self.counting:
            managed.compaction = None
        return managed.body, managed

    def view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return messages.view(body)

    def features(self, view: Mapping[str, Any], sent: json_body.Source | None = None) -> Features:
        return features_as_chat(view, "messages")

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: json_body.Source | None = None) -> tuple[bytes, bool]:
        return messages.upstream_body(body, served_model, None if self.counting else cap_tokens, source)

    def usage_of(self, answer: Mapping[str, Any]) -> Usage | None:
        return None if self.counting else messages.usage_of(answer)

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        if managed is None or self.counting:
            return raw, found
        found = anthropic_answers.answer(found, managed)
        return json_body.encode(found), found

    def answer_view(self, found: Mapping[str, Any]) -> dict[str, Any] | None:
        return None if self.counting else messages.answer_view(found)

    def stream_reader(self, client_wants_usage: bool, answer_id: str,
                      managed: Managed | None = None) -> messages.MessagesReader:
        return messages.MessagesReader() if managed is None else anthropic_answers.EditedMessagesReader(managed)

    def new_id(self) -> str:
        return ""

    def envelope(self, err: GatewayError) -> dict[str, Any]:
        return messages.envelope(err)

    def error_answer(self, status: int, raw: bytes, found: dict[str, Any]) -> bytes:
        return json_body.encode(messages.deployment_error(status, found))


MESSAGES = MessagesAdapter()
COUNT_TOKENS = MessagesAdapter(counting=True)
