"""Chat Completions, Completions and Embeddings as the gateway reads and writes them: request checks, output
caps, the deployment's body, SSE framing and what a stream generated."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from gateway.apis.json_body import Source, encode_edited, expect
from gateway.apis.recurring import Conversation, resume
from gateway.apis.usage import Usage, cached_of, reported_usage
from gateway.errors import BadRequest, GatewayError

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
OPERATION = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}


DONE_EVENT = b"data: [DONE]\n\n"


# A stream's first bytes kept to estimate what it generated when it ends without usage; past them, every
# further event counts as one token.
TALLY_KEPT_BYTES = 256 * 1024


def check(body: dict[str, Any], endpoint: str, conversation: Conversation | None = None) -> None:
    """Check the fields the gateway itself reads; every other field passes through untouched. `conversation`: the
    parse memory's of the messages, where their check is noted (a step that continues one checks what it adds)."""
    expect(body, "model", str, required=True)
    if endpoint == "chat":
        messages = expect(body, "messages", list, required=True)
        if not messages:
            raise BadRequest("'messages' must contain at least one message", param="messages")
        _, start, noting = resume(conversation, messages, _CHECKED)
        for i, message in enumerate(messages[start:], start):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]")
        if noting is not None:
            noting[_CHECKED] = True
    elif endpoint == "completions":
        expect(body, "prompt", (str, list), required=True)
    else:
        expect(body, "input", (str, list), required=True)
    for name, kind in _OPTIONAL_FIELDS.items():
        if name in body:  # most are absent: only a field that is there costs a call
            value = expect(body, name, kind)
            if kind is int and value is not None and value < 1:
                raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)


_CHECKED = "chat.checked"  # a conversation's messages passed the check, noted in the parse memory
# The optional fields the gateway reads, in the order they are checked; the integers are counts, at least 1.
_OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "stream": bool, "stream_options": dict, "tools": list, "max_tokens": int, "max_completion_tokens": int, "n": int,
    "temperature": (int, float),
}


# The fields each API's deployment reads as its cap on generated tokens per choice, in the order it reads
# them: the first one set wins (vLLM 0.32: chat_completion/protocol.py reads max_completion_tokens, else
# the deprecated max_tokens; completion/protocol.py reads max_tokens alone, and a max_completion_tokens
# there is ignored). The Responses API would be ("max_output_tokens",), Anthropic Messages ("max_tokens",).
OUTPUT_CAP_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "embeddings": (),
}


def output_cap(body: Mapping[str, Any], endpoint: str) -> int | None:
    """The cap on each choice's generated tokens that the deployment will obey for this body, or None when the
    body sets none (the deployment then stops at its own default or its context window).

    The one reading of a request's output cap: features, the hold and the cap the gateway sends all use it.
    """
    for name in OUTPUT_CAP_FIELDS.get(endpoint, ()):
        value = body.get(name)
        if value is not None:  # as vLLM reads it: the first field given decides, a later one is ignored
            return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None


def endpoint_of(body: Mapping[str, Any]) -> str:
    """The generating API a checked body was sent to, read from its shape (chat has messages, completions a
    prompt); for callers that do not name it."""
    return "chat" if "messages" in body else "completions"


def upstream_body(
    body: dict[str, Any], served_model: str, cap_tokens: int | None = None, *, endpoint: str | None = None,
    source: Source | None = None,
) -> tuple[bytes, bool]:
    """The body for a deployment: only `model` rewritten, usage always requested on streams, and, when
    `cap_tokens` is given (budgets apply), the output cap the hold assumed, written where the deployment of
    `endpoint` reads it first (left as it is when the body already caps at exactly that). `source`: the request's
    bytes and their parse, of which `body` is that parse or a copy with members added (encode_edited).

    Returns the encoded body and whether the client itself asked for the usage chunk (if not, the
    gateway drops it from the client's stream).
    """
    out = dict(body)
    out["model"] = served_model
    if cap_tokens is not None:
        fields = OUTPUT_CAP_FIELDS[endpoint or endpoint_of(body)]
        if fields and output_cap(body, endpoint or endpoint_of(body)) != cap_tokens:
            out[fields[0]] = cap_tokens
    client_wants_usage = True
    if body.get("stream"):
        options = body.get("stream_options") or {}
        client_wants_usage = bool(options.get("include_usage"))
        if not client_wants_usage:
            out["stream_options"] = {**options, "include_usage": True}
    return encode_edited(out, source), client_wants_usage


def choices_of(body: Mapping[str, Any], endpoint: str) -> int:
    """The completions one request generates: n (or best_of, generated before n are picked), times the
    prompts of a batched completions request."""
    per_prompt = max(_count(body.get("n")), _count(body.get("best_of")))
    prompt = body.get("prompt")
    if endpoint != "completions" or not isinstance(prompt, list) or not prompt:
        return per_prompt
    if all(isinstance(item, int) for item in prompt):  # a list of token ids is one tokenized prompt
        return per_prompt
    return per_prompt * len(prompt)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')


def model_named(chunk: bytes) -> str | None:
    """The `model` a stream's first event names, found without decoding the event."""
    found = _MODEL_FIELD.search(chunk)
    return found.group(1).decode("utf-8", "replace") if found else None


def usage_of(payload: Any) -> Usage | None:
    """A chat or completions answer's (or final chunk's) usage, with the prompt's cached tokens that vLLM
    reports under `--enable-prompt-tokens-details`."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return None
    return reported_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                          cached_of(usage.get("prompt_tokens_details")))


def is_usage_event(event: bytes) -> bool:
    """The final usage-only chunk of a stream (choices empty, usage set)."""
    if b'"usage"' not in event:
        return False
    compact = event.replace(b" ", b"")
    return b'"usage":{' in compact and b'"choices":[]' in compact


def event_data(event: bytes) -> Any:
    """The JSON payload of one SSE event (`data: {...}`), or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                try:
                    return json.loads(data)
                except (ValueError, RecursionError):  # nested deeper than the parser goes: not an event we read
                    return None
    return None


def error_event(err: GatewayError) -> bytes:
    """One SSE event carrying an OpenAI error; the OpenAI SDKs raise it as an APIError."""
    return b"data: " + json.dumps(err.envelope()).encode() + b"\n\n"


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each with its blank-line terminator) and the incomplete rest."""
    if b"\r\n" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return [], buffer
    complete, rest = buffer[: end + 2], buffer[end + 2 :]
    return [part + b"\n\n" for part in complete[:-2].split(b"\n\n")], rest


class StreamTally:
    """What a deployment streamed, to estimate the tokens it generated when no usage chunk arrives.

    `text_of` reads the text one event generated; chat and completions chunks by default, another API's
    events with that API's reader (gateway/apis/<api>/wire.py).
    """

    __slots__ = ("events", "kept", "kept_bytes", "text_of")

    def __init__(self, text_of: Callable[[bytes], str] | None = None) -> None:
        self.events = 0
        self.kept: list[bytes] = []
        self.kept_bytes = 0
        self.text_of = text_of or _generated_text

    def add(self, chunk: bytes) -> None:
        self.events += chunk.count(b"\n\n")
        if self.kept_bytes < TALLY_KEPT_BYTES:
            self.kept.append(chunk)
            self.kept_bytes += len(chunk)

    def completion_tokens(self, count: Callable[[str], int]) -> int:
        """Tokens generated so far: the larger of the events that carried text (each carried at least one
        token) and `count` of their text; one per event past the kept bytes."""
        events, _ = split_events(b"".join(self.kept))
        texts = [text for text in map(self.text_of, events) if text]
        beyond = max(0, self.events - len(events))
        return max(len(texts), count("".join(texts))) + beyond


def _generated_text(event: bytes) -> str:
    """The text one streamed chunk adds, over every choice: content, reasoning, tool calls, completions."""
    data = event_data(event)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        return ""
    parts: list[str] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts += [v for k in ("content", "reasoning_content") if isinstance(v := delta.get(k), str)]
            parts += _tool_text(delta.get("tool_calls"))
        text = choice.get("text")
        if isinstance(text, str):
            parts.append(text)
    return "".join(parts)


def _tool_text(calls: Any) -> list[str]:
    out: list[str] = []
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out += [v for k in ("name", "arguments") if isinstance(v := function.get(k), str)]
    return out
