"""The slice of the OpenAI API the gateway reads and writes: lenient request checks, usage, SSE framing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic_core

from gateway.errors import BadRequest, GatewayError

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
OPERATION = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
DONE_EVENT = b"data: [DONE]\n\n"


# A stream's first bytes kept to estimate what it generated when it ends without usage; past them, every
# further event counts as one token.
TALLY_KEPT_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0  # every prompt token, cached or not
    completion_tokens: int = 0
    estimated: bool = False  # counted by the gateway from a stream that ended without its usage chunk
    cached_tokens: int = 0  # of the prompt, read from the deployment's prefix cache (priced apart)
    cached_overstated: bool = False  # the deployment reported more cached tokens than prompt tokens: clamped
    # the usage carried a cached count (vLLM's --enable-prompt-tokens-details); when not, cached_tokens is 0 for
    # billing, but says nothing of the deployment's cache
    cached_reported: bool = False


def is_token_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_count(value: Any) -> int:
    """A reported token count: a non-negative integer, else 0 (a missing or garbled figure never raises)."""
    return value if is_token_count(value) else 0


def reported_usage(prompt_tokens: Any, completion_tokens: Any, cached_tokens: Any = None) -> Usage:
    """A deployment's usage from its raw figures. Cached tokens are part of the prompt: a count above the
    prompt's is clamped to it and flagged, so no price ever charges a negative number of uncached tokens."""
    prompt, cached = token_count(prompt_tokens), token_count(cached_tokens)
    return Usage(prompt, token_count(completion_tokens), cached_tokens=min(cached, prompt),
                 cached_overstated=cached > prompt, cached_reported=is_token_count(cached_tokens))


def cached_of(details: Any) -> Any:
    """The `cached_tokens` of a usage's details object (`prompt_tokens_details`, `input_tokens_details`)."""
    return details.get("cached_tokens") if isinstance(details, dict) else None


def decode(raw: bytes) -> dict[str, Any]:
    """Parse a request body; anything but a JSON object is a 400 that says what was wrong.

    pydantic's Rust parser takes about a quarter of json.loads' time on a small chat body; whatever it
    refuses gets a second parse by json, whose verdict stands: its error messages, and its leniency
    (a lone surrogate escape is valid JSON text to it).
    """
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        body = _decode_strictly(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def _decode_strictly(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BadRequest("The request body is not valid UTF-8") from exc
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise BadRequest(f"The request body is not valid JSON: {exc.msg} at {where}") from exc
    except RecursionError as exc:
        raise BadRequest("The request body nests arrays or objects too deeply") from exc


def check(body: dict[str, Any], endpoint: str) -> None:
    """Check the fields the gateway itself reads; every other field passes through untouched."""
    expect(body, "model", str, required=True)
    if endpoint == "chat":
        messages = expect(body, "messages", list, required=True)
        if not messages:
            raise BadRequest("'messages' must contain at least one message", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]")
    elif endpoint == "completions":
        expect(body, "prompt", (str, list), required=True)
    else:
        expect(body, "input", (str, list), required=True)
    for name, kind in _OPTIONAL_FIELDS.items():
        if name in body:  # most are absent: only a field that is there costs a call
            value = expect(body, name, kind)
            if kind is int and value is not None and value < 1:
                raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)


# The optional fields the gateway reads, in the order they are checked; the integers are counts, at least 1.
_OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "stream": bool, "stream_options": dict, "tools": list, "max_tokens": int, "max_completion_tokens": int, "n": int,
    "temperature": (int, float),
}


def expect(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = False) -> Any:
    """The field's value when it has the wanted JSON type (None when absent); else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"Missing required parameter: '{name}'", param=name, code="missing_required_parameter")
        return None
    # bool is an int in Python; a JSON true is never a valid count.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(
            f"Invalid type for '{name}': expected {_json_type(wanted)}, got {_json_type(type(value).__name__)}",
            param=name,
            code="invalid_type",
        )
    return value


def _json_type(py: str) -> str:
    names = {"str": "a string", "list": "an array", "dict": "an object", "int": "an integer",
             "float": "a number", "bool": "a boolean"}
    return " or ".join(names.get(part, part) for part in py.split(" or "))


# json.dumps with separators builds a new encoder per call; one shared encoder skips that on the hot path.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def encode(value: Any) -> bytes:
    """Compact JSON: pydantic's Rust encoder (about 4x json's speed), or json for what it cannot write
    (a lone surrogate in a string, which json.loads accepts). NaN and Infinity stay as json writes them."""
    try:
        return pydantic_core.to_json(value, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError:
        return _COMPACT.encode(value).encode()


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
    body: dict[str, Any], served_model: str, cap_tokens: int | None = None, *, endpoint: str | None = None
) -> tuple[bytes, bool]:
    """The body for a deployment: only `model` rewritten, usage always requested on streams, and, when
    `cap_tokens` is given (budgets apply), the output cap the hold assumed, written where the deployment of
    `endpoint` reads it first (left as it is when the body already caps at exactly that).

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
    return encode(out), client_wants_usage


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


def response_object(raw: bytes) -> dict[str, Any] | None:
    """A deployment's JSON answer as an object; None when it is anything else (HTML, garbage, an array)."""
    try:
        found = pydantic_core.from_json(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


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
    events with that API's reader (gateway/wire/).
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
