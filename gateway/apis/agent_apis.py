"""The agents' own APIs: OpenAI's Responses (Codex CLI, the Agents SDK) and Anthropic's Messages (Claude Code).

The decision reads each through its chat-shaped view (gateway/wire/); what reaches the deployment and the
client is the API's own body and events, forwarded to the deployment's own endpoint for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway import openai
from gateway.apis.responses import compaction
from gateway.context import anthropic_answers, tool_outputs
from gateway.context.anthropic_config import FIELD, read_edits
from gateway.context.anthropic_edits import Managed, manage
from gateway.errors import BadRequest, GatewayError
from gateway.features import Features, extract
from gateway.wire import messages, responses


def _features(view: Mapping[str, Any], api: str) -> Features:
    features = extract(view, "chat")
    features.endpoint = api  # read as chat; the decision knows which API the deployment must serve
    return features


class ResponsesAdapter:
    """`POST /v1/responses`. The gateway names every response (an unguessable id) and keeps the stored ones."""

    endpoint, path, operation = "responses", responses.PATH, "chat"
    chains, generates, step_from_chunks = True, True, False
    tool_outputs: tool_outputs.ToolOutputs | None = tool_outputs.RESPONSES

    def parse(self, raw: bytes) -> dict[str, Any]:
        body = openai.decode(raw)
        responses.check(body)
        compaction.check(body)
        return body

    def manage_context(self, body: dict[str, Any]) -> tuple[dict[str, Any], Managed | None]:
        return body, None

    def view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return responses.view(body)

    def features(self, view: Mapping[str, Any]) -> Features:
        return _features(view, self.endpoint)

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: openai.Source | None = None) -> tuple[bytes, bool]:
        return responses.upstream_body(body, served_model, cap_tokens, source)

    def usage_of(self, answer: Mapping[str, Any]) -> openai.Usage | None:
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

    def parse(self, raw: bytes) -> dict[str, Any]:
        body = openai.decode(raw)
        body.setdefault("input", [])  # a chain alone (previous_response_id) is compacted too
        if body.get("stream") is True:
            raise BadRequest("POST /v1/responses/compact does not stream", param="stream")
        responses.check(body)
        compaction.check(body)
        return body


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
        return openai.encode(found), found

    def stream_reader(self, client_wants_usage: bool, answer_id: str,
                      managed: Managed | None = None) -> compaction.CompactedStream:
        return compaction.CompactedStream(answer_id, self.item)


class MessagesAdapter:
    """`POST /v1/messages` (and, with `counting`, `/v1/messages/count_tokens`, which generates nothing)."""

    operation, chains, step_from_chunks = "chat", False, False
    tool_outputs: tool_outputs.ToolOutputs | None = tool_outputs.MESSAGES

    def __init__(self, counting: bool = False) -> None:
        self.counting = counting
        self.generates = not counting
        self.endpoint = "messages_count_tokens" if counting else "messages"
        self.path = messages.COUNT_TOKENS_PATH if counting else messages.PATH

    def parse(self, raw: bytes) -> dict[str, Any]:
        body = openai.decode(raw)
        messages.check(body, count_tokens=self.counting)
        return body

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

    def features(self, view: Mapping[str, Any]) -> Features:
        return _features(view, "messages")

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: openai.Source | None = None) -> tuple[bytes, bool]:
        return messages.upstream_body(body, served_model, None if self.counting else cap_tokens, source)

    def usage_of(self, answer: Mapping[str, Any]) -> openai.Usage | None:
        return None if self.counting else messages.usage_of(answer)

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        if managed is None or self.counting:
            return raw, found
        found = anthropic_answers.answer(found, managed)
        return openai.encode(found), found

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
        return openai.encode(messages.deployment_error(status, found))


RESPONSES = ResponsesAdapter()
RESPONSES_COMPACT = ResponsesCompactAdapter()
MESSAGES = MessagesAdapter()
COUNT_TOKENS = MessagesAdapter(counting=True)
