"""OpenAI's Responses API (Codex CLI, the Agents SDK) as the gateway serves it: `POST /v1/responses`, and
`/v1/responses/compact`, which the gateway answers itself.

The decision reads a request through its chat-shaped view (wire.view); what reaches the deployment and the client
is the API's own body and events, forwarded to the deployment's own /v1/responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.apis import json_body
from gateway.apis.adapter import features_as_chat
from gateway.apis.recurring import Recurring
from gateway.apis.responses import compaction
from gateway.apis.responses import wire as responses
from gateway.apis.usage import Usage
from gateway.context import eviction, retrieval, tool_outputs
from gateway.context.anthropic_edits import Managed
from gateway.context.tool_outputs import RESPONSES_ASSISTANT, ToolOutputs
from gateway.errors import BadRequest, GatewayError
from gateway.features import Features


class ResponsesAdapter:
    """`POST /v1/responses`. The gateway names every response (an unguessable id) and keeps the stored ones."""

    endpoint, path, operation = "responses", responses.PATH, "chat"
    chains, generates, resumable, step_from_chunks = True, True, True, False
    tool_outputs: tool_outputs.ToolOutputs | None = tool_outputs.RESPONSES
    turns: eviction.TurnShape | None = eviction.RESPONSES
    block: retrieval.BlockShape | None = retrieval.RESPONSES
    assistant_texts: ToolOutputs | None = RESPONSES_ASSISTANT

    def parse(self, raw: bytes, recurring: Recurring | None = None) -> json_body.Source:
        sent = json_body.read(raw, "input", recurring)
        responses.check(sent.body)
        compaction.check(sent.body)
        return sent

    def manage_context(self, body: dict[str, Any]) -> tuple[dict[str, Any], Managed | None]:
        return body, None

    def view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return responses.view(body)

    def features(self, view: Mapping[str, Any], sent: json_body.Source | None = None) -> Features:
        return features_as_chat(view, self.endpoint)

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: json_body.Source | None = None) -> tuple[bytes, bool]:
        return responses.upstream_body(body, served_model, cap_tokens, source)

    def usage_of(self, answer: Mapping[str, Any]) -> Usage | None:
        return responses.usage_of(answer)

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        return responses.adopt_answer(raw, found, answer_id)

    def answer_view(self, found: Mapping[str, Any]) -> dict[str, Any] | None:
        return responses.answer_view(found)

    def stream_reader(self, client_wants_usage: bool, answer_id: str,
                      managed: Managed | None = None) -> responses.ResponsesReader:
        return responses.ResponsesReader(answer_id)

    def new_id(self) -> str:
        return responses.new_response_id()

    def envelope(self, err: GatewayError) -> dict[str, Any]:
        return responses.envelope(err)

    def error_answer(self, status: int, raw: bytes, found: dict[str, Any]) -> bytes:
        return raw  # vLLM's own, in OpenAI's envelope


class ResponsesCompactAdapter(ResponsesAdapter):
    """`POST /v1/responses/compact`: read as a Responses request (its input or its chain), answered by the gateway
    itself with a compaction (server/compaction.py); no deployment serves this path."""

    path = compaction.COMPACT_PATH

    def parse(self, raw: bytes, recurring: Recurring | None = None) -> json_body.Source:
        sent = json_body.read(raw, "input", recurring)
        body = sent.body
        body.setdefault("input", [])  # a chain alone (previous_response_id) is compacted too
        if body.get("stream") is True:
            raise BadRequest("POST /v1/responses/compact does not stream", param="stream")
        responses.check(body)
        compaction.check(body)
        return sent


class CompactedResponsesAdapter(ResponsesAdapter):
    """A Responses call whose input the gateway compacted first (context_management): the answer's output starts
    with the compaction item, streamed or not."""

    def __init__(self, item: dict[str, Any]) -> None:
        self.item = item

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        _, found = responses.adopt_answer(raw, found, answer_id)
        output = found.get("output")
        found = {**found, "output": [self.item, *(output if isinstance(output, list) else [])]}
        return json_body.encode(found), found

    def stream_reader(self, client_wants_usage: bool, answer_id: str,
                      managed: Managed | None = None) -> compaction.CompactedStream:
        return compaction.CompactedStream(answer_id, self.item)


RESPONSES = ResponsesAdapter()
RESPONSES_COMPACT = ResponsesCompactAdapter()
