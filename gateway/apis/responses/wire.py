"""The OpenAI Responses API (`POST /v1/responses`) as the gateway reads and writes it.

    body = json_body.decode(raw); check(body)
    body = stored.expand(body, record) when body names a `previous_response_id` (wire/stored.py)
    view(body) -> the chat-shaped body features.extract(…, "chat") and steps.read_step read
    upstream_body(body, served_model, cap) -> what the deployment gets (its store stays off: the gateway's is used)
    non-streamed: usage_of(answer); adopt_answer(raw, answer, gateway id) before the client gets it
    streamed: ResponsesReader(gateway id).feed(chunk) per chunk; .usage .done .final; .error_event(err)

The gateway names every response itself (`new_response_id`, unguessable): the deployment's own id (vLLM's is
64 random bits) is replaced in what the client gets, so retrieve and chaining use the gateway's store only.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

from gateway.apis import events, json_body
from gateway.apis.chat.wire import StreamTally
from gateway.apis.events import EventReader
from gateway.apis.json_body import Source, expect
from gateway.apis.usage import Usage, cached_of, reported_usage
from gateway.errors import BadRequest, GatewayError, RateLimited

PATH = "/v1/responses"
CAP_FIELD = "max_output_tokens"
TERMINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


def new_response_id() -> str:
    """A response id no client can guess: 192 random bits."""
    return "resp_" + secrets.token_hex(24)


def check(body: Mapping[str, Any]) -> None:
    """The fields the gateway reads; every other field passes through untouched."""
    expect(body, "model", str, required=True)
    items = expect(body, "input", (str, list), required=True)
    if isinstance(items, list):
        start = max(0, len(items) - events.MAX_VIEW_ITEMS)
        for i in range(start, len(items)):
            if not isinstance(items[i], dict):
                raise BadRequest(f"'input[{i}]' must be an object", param=f"input[{i}]", code="invalid_type")
    for name, kind in (("instructions", str), ("stream", bool), ("store", bool), ("tools", list),
                       ("previous_response_id", str), ("temperature", (int, float)), ("text", dict)):
        expect(body, name, kind)
    cap = expect(body, CAP_FIELD, int)
    if cap is not None and cap < 1:
        raise BadRequest(f"'{CAP_FIELD}' must be at least 1, got {cap}", param=CAP_FIELD)


def input_items(body: Mapping[str, Any]) -> list[Any]:
    """The request's input as items (a string input is one user message)."""
    found = body.get("input")
    if isinstance(found, str):
        return [{"role": "user", "content": found}]
    return found if isinstance(found, list) else []


def view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request as a chat completion: instructions as the system message, items as messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for item in events.newest(input_items(body)):
        if isinstance(item, dict):
            _add_item(messages, item)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream") is True}
    tools = [_tool(t) for t in events.parts(body.get("tools"))] if isinstance(body.get("tools"), list) else []
    if tools:
        chat["tools"] = tools
    for name, chat_name in ((CAP_FIELD, "max_tokens"), ("temperature", "temperature"), ("user", "user")):
        if name in body:
            chat[chat_name] = body[name]
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        chat["response_format"] = text["format"]
    return chat


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """One input item onto the chat messages; a tool call joins the assistant message before it."""
    kind = item.get("type")
    if kind in (None, "message"):
        role = item.get("role")
        if isinstance(role, str):
            messages.append({"role": role, "content": events.content_view(item.get("content"))})
    elif isinstance(kind, str) and kind.endswith("_call_output"):  # function_call_output, custom_tool_call_output, …
        messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                         "content": events.content_view(item.get("output"))})
    elif isinstance(kind, str) and kind.endswith("_call"):  # function_call, custom_tool_call, local_shell_call, …
        arguments = item.get("arguments", item.get("input", item.get("action")))
        call = events.tool_call(item.get("call_id"), item.get("name") or kind, arguments)
        last = messages[-1] if messages else {}
        calls = last.setdefault("tool_calls", []) if last.get("role") == "assistant" else None
        if calls is not None and len(calls) < events.MAX_PARTS:
            calls.append(call)  # parallel calls, or the calls of the assistant message just before them
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _tool(spec: Any) -> dict[str, Any]:
    """A Responses tool as a chat tool: function and custom tools by name, built-in ones by their type."""
    if not isinstance(spec, dict):
        return events.function_tool("", None, None)
    name = spec.get("name") or spec.get("type")
    return events.function_tool(name, spec.get("description"), spec.get("parameters", spec.get("format")))


def upstream_body(
    body: dict[str, Any], served_model: str, cap_tokens: int | None = None, source: Source | None = None
) -> tuple[bytes, bool]:
    """The (expanded) body for a deployment: `model` rewritten, the gateway's cap when it sets one, and the
    deployment's own store off (the gateway keeps the state; a deployment's store would only leak memory).
    The usage is always in the final event, so the client never lacks it: the flag is True. `source`: the
    request's bytes and their parse (json_body.encode_edited)."""
    out = dict(body)
    out["model"] = served_model
    out["store"] = False
    out.pop("previous_response_id", None)
    if cap_tokens is not None:
        out[CAP_FIELD] = cap_tokens
    return json_body.encode_edited(out, source), True


def usage_of(answer: Any) -> Usage | None:
    """A response object's usage (a non-streamed answer, or a terminal event's `response`)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    return reported_usage(usage.get("input_tokens"), usage.get("output_tokens"),
                                 cached_of(usage.get("input_tokens_details")))


def adopt(raw: bytes, upstream_id: str | None, response_id: str) -> bytes:
    """A deployment's answer with its response id replaced by the gateway's."""
    if not upstream_id or upstream_id == response_id:
        return raw
    return raw.replace(b'"' + upstream_id.encode() + b'"', b'"' + response_id.encode() + b'"')


def adopt_answer(raw: bytes, answer: dict[str, Any], response_id: str) -> tuple[bytes, dict[str, Any]]:
    """A non-streamed answer (its bytes and object) under the gateway's response id."""
    upstream_id = answer.get("id")
    return adopt(raw, upstream_id if isinstance(upstream_id, str) else None, response_id), {**answer, "id": response_id}


def answer_view(answer: Mapping[str, Any]) -> dict[str, Any]:
    """A response object as a chat completion, for the agent step (its text and function calls)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in events.parts(answer.get("output")):
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            texts += [p["text"] for p in events.parts(item.get("content")) if isinstance(p, dict)
                      and isinstance(p.get("text"), str)]
        elif isinstance(kind, str) and kind.endswith("_call"):
            calls.append(events.tool_call(item.get("call_id"), item.get("name") or kind,
                                          item.get("arguments", item.get("input"))))
    return events.answer_view("".join(texts), calls)


def generated_text(event: bytes) -> str:
    """The text one stream event generated: output text, reasoning, tool-call arguments and names."""
    kind = events.event_type(event)
    if kind.endswith(b".delta"):
        delta = events.data_of(event).get("delta")
        return delta if isinstance(delta, str) else ""
    if kind == b"response.output_item.added":
        item = events.data_of(event).get("item")
        name = item.get("name") if isinstance(item, dict) else None
        return name if isinstance(name, str) else ""
    return ""


def failure_code(err: GatewayError) -> str:
    """The `response.error.code` OpenAI's clients know for a gateway error."""
    return "rate_limit_exceeded" if isinstance(err, RateLimited) else "server_error"


class ResponsesReader(EventReader):
    """Reads a Responses stream as it is relayed: its model, the usage of its terminal event (completed,
    incomplete or failed), the final response object (for the store), and renames the response."""

    READ = frozenset({b"response.created", b"error", *TERMINAL})
    __slots__ = ("created", "final", "response_id", "sequence", "upstream_id")

    def __init__(self, response_id: str) -> None:
        super().__init__(StreamTally(generated_text))
        self.response_id = response_id
        self.upstream_id: str | None = None
        self.created: dict[str, Any] = {}  # the first event's response object: the template of a failure
        self.final: dict[str, Any] | None = None  # the terminal event's response object, renamed
        self.sequence = -1  # the last event's sequence_number

    def feed(self, chunk: bytes) -> bytes:
        out = adopt(super().feed(chunk), self.upstream_id, self.response_id)
        numbers = _SEQUENCE.findall(out[-256:]) if out else None
        if numbers:
            self.sequence = int(numbers[-1])
        return out

    def read(self, kind: bytes, event: bytes) -> None:
        if kind == b"error":
            self.error = True
            return
        response = events.data_of(event).get("response")
        if not isinstance(response, dict):
            return
        if kind == b"response.created":
            self.upstream_id = response.get("id") if isinstance(response.get("id"), str) else None
            self.model = response.get("model") if isinstance(response.get("model"), str) else None
            self.created = response
            return
        self.done = True
        self.usage = usage_of(response)
        self.final = {**response, "id": self.response_id}

    def answer_view(self) -> dict[str, Any]:
        """What was streamed as a chat completion, for the agent step: read from the final response object."""
        return answer_view(self.final) if self.final is not None else events.answer_view("", [])

    def error_event(self, err: GatewayError) -> bytes:
        """The end of a stream that failed after its first byte, as OpenAI's API ends one: an `error` event
        (the Agents SDK raises it), then `response.failed` with the same response id (what Codex reads)."""
        first = {"type": "error", "code": err.code or err.error_type, "message": err.message, "param": err.param,
                 "sequence_number": self.sequence + 1}
        failed = {**self.created, "id": self.response_id, "object": "response", "status": "failed",
                  "error": {"code": failure_code(err), "message": err.message}, "output": [],
                  "usage": None, "incomplete_details": None}
        failed.setdefault("model", self.model or "")
        failed.setdefault("created_at", 0)
        for name, default in (("parallel_tool_calls", True), ("tool_choice", "auto"), ("tools", [])):
            failed.setdefault(name, default)
        last = {"type": "response.failed", "response": failed, "sequence_number": self.sequence + 2}
        return events.sse("error", first) + events.sse("response.failed", last)


def envelope(err: GatewayError) -> dict[str, Any]:
    """The Responses API's errors are OpenAI's envelope."""
    return err.envelope()
