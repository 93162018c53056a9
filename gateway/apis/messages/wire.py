"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as the gateway reads and writes it.

    body = json_body.decode(raw); check(body)   (check(body, count_tokens=True) for count_tokens)
    view(body) -> the chat-shaped body features.extract(…, "chat") and steps.read_step read
    upstream_body(body, served_model, cap) -> what the deployment gets
    non-streamed: usage_of(answer), answer_view(answer)
    streamed: MessagesReader().feed(chunk) per chunk; .usage .done .answer_view(); error_event(err)
    errors: envelope(err) -> {"type": "error", "error": {"type", "message"}}, with Anthropic's error types;
            deployment_error(status, found) -> a deployment's error answer (vLLM's own in OpenAI's envelope too)
            in that envelope; error_event(err) -> the `event: error` that ends a stream after its first byte
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.apis import events, json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.chat.wire import StreamTally
from gateway.apis.events import EventReader
from gateway.apis.json_body import Source, expect
from gateway.apis.messages import content as message_content
from gateway.apis.usage import Usage, reported_usage, token_count
from gateway.errors import BadRequest, GatewayError

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
CAP_FIELD = "max_tokens"
# Anthropic's error types by HTTP status (its SDKs retry 429, 5xx and overloaded_error); api_error otherwise.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               431: "request_too_large", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def check(body: Mapping[str, Any], *, count_tokens: bool = False) -> None:
    """The fields the gateway reads; every other field passes through untouched. count_tokens takes no cap."""
    expect(body, "model", str, required=True)
    messages = expect(body, "messages", list, required=True)
    start = max(0, len(messages) - events.MAX_VIEW_ITEMS)
    for i in range(start, len(messages)):
        message = messages[i]
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]")
    for name, kind in (("system", (str, list)), ("stream", bool), ("tools", list), ("temperature", (int, float))):
        expect(body, name, kind)
    cap = expect(body, CAP_FIELD, int, required=not count_tokens)
    if cap is not None and cap < 1:
        raise BadRequest(f"'{CAP_FIELD}' must be at least 1, got {cap}", param=CAP_FIELD)
    message_content.check(messages, start)


def view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request as a chat completion: system blocks as the system message, tool_use blocks as tool calls,
    tool_result blocks as tool messages (`is_error` kept on them)."""
    chat_messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        chat_messages.append({"role": "system", "content": events.content_view(system)})
    found = body.get("messages")
    chat_messages += events.newest_messages(found if isinstance(found, list) else [], _messages)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages,
                            "stream": body.get("stream") is True}
    tools = [_tool(t) for t in events.parts(body.get("tools"))]
    if tools:
        chat["tools"] = tools
    for name in (CAP_FIELD, "temperature"):
        if name in body:
            chat[name] = body[name]
    return chat


def _messages(message: Any) -> list[dict[str, Any]]:
    """One Messages message as the chat messages it stands for."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return []
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [b for b in events.parts(content) if isinstance(b, dict)]
    if role == "assistant":
        calls = [events.tool_call(b.get("id"), b.get("name"), b.get("input")) for b in blocks
                 if b.get("type") in ("tool_use", "server_tool_use")]
        out: dict[str, Any] = {"role": "assistant", "content": [b for b in blocks if b.get("type") == "text"]}
        if calls:
            out["tool_calls"] = calls
        return [out]
    results = [_tool_message(b) for b in blocks if b.get("type") == "tool_result"]
    rest = [b for b in blocks if b.get("type") != "tool_result"]
    if not results:
        return [{"role": role, "content": rest}]
    # Text sent beside tool results (Claude Code's reminders) is context of the tool-result step, not a new
    # user turn: it goes before the tool messages, so the step still reads as feeding results back.
    return ([{"role": role, "content": rest}] if rest else []) + results


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
           "content": events.content_view(block.get("content"))}
    if isinstance(block.get("is_error"), bool):  # false says so too (Claude Code sends it on every result)
        out["is_error"] = block["is_error"]
    return out


def _tool(spec: Any) -> dict[str, Any]:
    """A Messages tool as a chat tool: custom tools with their schema, server tools by name or type."""
    if not isinstance(spec, dict):
        return events.function_tool("", None, None)
    return events.function_tool(spec.get("name") or spec.get("type"), spec.get("description"),
                                spec.get("input_schema"))


def upstream_body(
    body: dict[str, Any], served_model: str, cap_tokens: int | None = None, source: Source | None = None
) -> tuple[bytes, bool]:
    """The body for a deployment: `model` rewritten and the gateway's cap when it sets one (the usage is
    always in the stream's message_start and message_delta events: the client never lacks it). `source`: the
    request's bytes and their parse (json_body.encode_edited)."""
    out = dict(body)
    out["model"] = served_model
    if cap_tokens is not None:
        out[CAP_FIELD] = cap_tokens
    return json_body.encode_edited(out, source), True


def usage_of(answer: Any) -> Usage | None:
    """A message's usage; the prompt is every input token, cached or not (Anthropic counts them apart, and
    vLLM reports its prefix-cache hits as `cache_read_input_tokens` under `--enable-prompt-tokens-details`)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    return reported_usage(_prompt_tokens(usage), usage.get("output_tokens"),
                                 usage.get("cache_read_input_tokens"))


def _prompt_tokens(usage: Mapping[str, Any]) -> int:
    return sum(token_count(usage.get(k)) for k in
               ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


def answer_view(answer: Mapping[str, Any]) -> dict[str, Any]:
    """A message as a chat completion, for the agent step (its text and tool_use blocks)."""
    blocks = [b for b in events.parts(answer.get("content")) if isinstance(b, dict)]
    text = "".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))
    calls = [events.tool_call(b.get("id"), b.get("name"), b.get("input")) for b in blocks
             if b.get("type") == "tool_use"]
    return events.answer_view(text, calls)


def generated_text(event: bytes) -> str:
    """The text one stream event generated: text, thinking, tool input JSON, a tool_use block's name."""
    kind = events.event_type(event)
    if kind == b"content_block_delta":
        delta = events.data_of(event).get("delta")
        if isinstance(delta, dict):
            return next((v for k in ("text", "thinking", "partial_json") if isinstance(v := delta.get(k), str)), "")
    elif kind == b"content_block_start":
        block = events.data_of(event).get("content_block")
        name = block.get("name") if isinstance(block, dict) else None
        return name if isinstance(name, str) else ""
    return ""


class MessagesReader(EventReader):
    """Reads a Messages stream as it is relayed: the model and prompt of `message_start`, the output (and
    any later input count) of `message_delta`, and the `message_stop` that ends it. Content events go on
    unparsed; `answer_view` reads them back from the kept bytes, once, when the agent step asks."""

    READ = frozenset({b"message_start", b"message_delta", b"message_stop", b"error"})
    # A deployment's own error event (vLLM's names types Anthropic's clients do not know) is not relayed: the
    # relay ends the stream with the gateway's, in Anthropic's envelope and types.
    WITHHOLDS_ERROR = True
    __slots__ = ("_prompt",)

    def __init__(self) -> None:
        super().__init__(StreamTally(generated_text))
        self._prompt: dict[str, Any] = {}

    def read(self, kind: bytes, event: bytes) -> None:
        data = events.data_of(event)
        if kind == b"message_start":
            found = data.get("message")
            message: dict[str, Any] = found if isinstance(found, dict) else {}
            self.model = message.get("model") if isinstance(message.get("model"), str) else None
            usage = message.get("usage")
            self._prompt = usage if isinstance(usage, dict) else {}
        elif kind == b"message_delta" and isinstance(data.get("usage"), dict):
            # The final count: message_delta's are cumulative, and its input counts, when present, supersede
            # message_start's. Until it comes there is no usage: a cut stream is estimated from what it streamed.
            self.usage = usage_of({"usage": {**self._prompt, **data["usage"]}})
        elif kind == b"message_stop":
            self.done = True
        elif kind == b"error":
            self.error = True

    def error_event(self, err: GatewayError) -> bytes:
        return error_event(err)

    def answer_view(self) -> dict[str, Any]:
        """What was streamed (its kept bytes) as a chat completion: text and tool_use blocks."""
        streamed, _ = chat_wire.split_events(b"".join(self.streamed.kept))
        blocks: dict[int, dict[str, Any]] = {}
        for event in streamed:
            if events.event_type(event) in (b"content_block_start", b"content_block_delta"):
                _accumulate(blocks, events.data_of(event))
        return answer_view({"content": [blocks[i] for i in sorted(blocks)]})


def _accumulate(blocks: dict[int, dict[str, Any]], data: dict[str, Any]) -> None:
    """One content event onto the blocks it builds: text appended, a tool_use block's input JSON joined."""
    index, block, delta = data.get("index"), data.get("content_block"), data.get("delta")
    if not isinstance(index, int):
        return
    if isinstance(block, dict) and len(blocks) < events.MAX_PARTS:
        blocks[index] = {"type": block.get("type"), "id": block.get("id"), "name": block.get("name"),
                         "text": "", "input": ""}
    elif isinstance(delta, dict) and index in blocks:
        found = blocks[index]
        for source, target in (("text", "text"), ("partial_json", "input")):
            if isinstance(delta.get(source), str):
                found[target] += delta[source]


def error_type(err: GatewayError) -> str:
    return ERROR_TYPES.get(err.status, "api_error")


def envelope(err: GatewayError) -> dict[str, Any]:
    """Anthropic's error body: its SDKs read `error.type` and `error.message`."""
    return {"type": "error", "error": {"type": error_type(err), "message": err.message}}


def error_event(err: GatewayError) -> bytes:
    """The one event that ends a stream which failed after its first byte; the Anthropic SDKs raise it."""
    return events.sse("error", envelope(err))


def deployment_error(status: int, found: Mapping[str, Any]) -> dict[str, Any]:
    """A deployment's error answer as Anthropic's API gives it: vLLM answers its own request validation on this
    path in OpenAI's envelope, and its other errors with OpenAI's type names; both keep `error.message`, which
    the client gets as the deployment wrote it, with the error type of the status."""
    error = found.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = f"The deployment answered {status}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
