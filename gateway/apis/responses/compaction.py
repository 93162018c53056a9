"""Compaction in the Responses API, as OpenAI's clients expect it, served by the gateway's own summarizer.

Three ways a client asks (the `trigger` label of gateway_compactions_total):
    v1_compact          POST /v1/responses/compact → {"object": "response.compaction", "output": [the user
                        messages…, one compaction item], "usage"} (Codex before remote compaction v2)
    v2_trigger          POST /v1/responses whose input ends in {"type": "compaction_trigger"} → a response whose
                        output is exactly one compaction item, streamed or not (Codex's remote compaction v2)
    context_management  POST /v1/responses with context_management [{type: compaction, compact_threshold}]:
                        over the threshold the input is compacted first; the answer's output starts with the
                        compaction item

A compaction item is {"type": "compaction", "id": "cmp_…", "encrypted_content": <the gateway's sealed token>}
(gateway/context/seal.py). Sent back as input, `open_input` checks every one (400 when it does not open) and
puts the summary in the latest one's place as a user message; before it only the user's own messages are kept
(the summary stands in for the rest, as OpenAI's compaction does). No deployment ever reads a compaction item.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from gateway.apis import events
from gateway.apis.chat import wire as chat_wire
from gateway.apis.responses.wire import TERMINAL, ResponsesReader, input_items
from gateway.context.seal import Seal, SealError
from gateway.context.summaries import SUMMARY_LEAD, summary_message_text
from gateway.errors import BadRequest

COMPACT_PATH = "/v1/responses/compact"
TRIGGER, ITEM = "compaction_trigger", "compaction"
V1_COMPACT, V2_TRIGGER, CONTEXT_MANAGEMENT = "v1_compact", "v2_trigger", "context_management"
RETAINED_CHARS = 256_000  # the user's own messages kept verbatim beside a summary, newest first (~64k tokens)
KEPT_ROLES = frozenset({"user", "system", "developer"})  # what stays before a compaction item: the client's own


def check(body: Mapping[str, Any]) -> None:
    """The compaction fields of a Responses body: a trigger only last, items with their token, the threshold."""
    items = input_items(body)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == TRIGGER and i != len(items) - 1:
            raise BadRequest("A 'compaction_trigger' item must be the last input item", param=f"input[{i}]")
        if kind == ITEM and not isinstance(item.get("encrypted_content"), str):
            raise BadRequest("A 'compaction' item needs its 'encrypted_content' string",
                             param=f"input[{i}].encrypted_content", code="invalid_type")
    threshold_of(body)


def is_triggered(body: Mapping[str, Any]) -> bool:
    """Whether the input ends in a compaction_trigger item (remote compaction v2)."""
    items = input_items(body)
    return bool(items) and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER


def threshold_of(body: Mapping[str, Any]) -> int | None:
    """The `compact_threshold` of the body's `context_management` compaction entry (None: none asked)."""
    entries = body.get("context_management")
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BadRequest("'context_management' must be a list of objects", param="context_management",
                         code="invalid_type")
    for i, entry in enumerate(entries):
        if entry.get("type") != ITEM:
            raise BadRequest(f"Unsupported context_management type {entry.get('type')!r}; supported: 'compaction'",
                             param=f"context_management[{i}].type")
        threshold = entry.get("compact_threshold")
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
            raise BadRequest("'compact_threshold' must be a positive integer (tokens)",
                             param=f"context_management[{i}].compact_threshold", code="invalid_type")
        return threshold
    return None


def open_input(items: list[Any], seal: Seal, tenant: str) -> tuple[list[Any], int]:
    """The input with its compaction items opened: the latest one's summary in its place, and before it only the
    client's own messages (no earlier summary, no tool traffic: the summary holds them); and how many it held.
    A compaction item that does not open under the gateway's key for this tenant is a 400."""
    found = [i for i, item in enumerate(items) if isinstance(item, dict) and item.get("type") == ITEM]
    if not found:
        return items, 0
    summaries = [_opened(items[i], i, seal, tenant) for i in found]
    latest = found[-1]
    kept = [item for item in items[:latest] if _client_message(item)]
    return [*kept, summary_message(summaries[-1]), *items[latest + 1:]], len(found)


def _opened(item: Mapping[str, Any], index: int, seal: Seal, tenant: str) -> str:
    token = item.get("encrypted_content")
    try:
        payload = seal.open(token if isinstance(token, str) else "", tenant)
    except SealError as exc:
        raise BadRequest(f"The compaction item at input[{index}] does not open: {exc}. Compaction items come "
                         "from this gateway's /v1/responses/compact or compaction_trigger, unchanged",
                         param=f"input[{index}].encrypted_content", code="invalid_compaction_item") from exc
    summary = payload.get("summary")
    if not isinstance(summary, str):
        raise BadRequest(f"The compaction item at input[{index}] holds no summary",
                         param=f"input[{index}].encrypted_content", code="invalid_compaction_item")
    return summary


def _client_message(item: Any) -> bool:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in KEPT_ROLES:
        return False
    return not _text(item).startswith(SUMMARY_LEAD)  # a summary the gateway put in: the later one replaces it


def summary_message(summary: str) -> dict[str, Any]:
    """The summary as the deployment reads it: a user message (every chat template takes one anywhere)."""
    text = summary_message_text(summary)
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def without_trigger(items: list[Any]) -> list[Any]:
    return items[:-1] if items and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER else items


def retained(items: list[Any]) -> list[Any]:
    """The user's own messages kept verbatim beside a summary, newest first within RETAINED_CHARS."""
    kept: list[Any] = []
    size = 0
    for item in reversed(items):
        if isinstance(item, dict) and item.get("role") == "user" and _client_message(item):
            size += len(_text(item))
            if size > RETAINED_CHARS and kept:
                break
            kept.append(item)
    kept.reverse()
    return kept


def _text(item: Mapping[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    texts = [p.get("text") for p in events.parts(content) if isinstance(p, dict)]
    return "".join(t for t in texts if isinstance(t, str))


def output_message(item: Mapping[str, Any]) -> dict[str, Any]:
    """A kept user message as /compact's output lists it (OpenAI's shape: an id, a status, input_text parts)."""
    content = item.get("content")
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return {"id": item.get("id") or "msg_" + secrets.token_hex(24), "type": "message", "status": "completed",
            "role": item.get("role"), "content": parts}


def compaction_item(token: str) -> dict[str, Any]:
    return {"id": "cmp_" + secrets.token_hex(24), "type": ITEM, "encrypted_content": token}


def sealed_payload(summary: str, deployment: str, tokens_before: int, tokens_after: int) -> dict[str, Any]:
    """What a compaction item carries: the summary, who wrote it, when, and the context it replaced."""
    return {"summary": summary, "by": deployment, "at": int(time.time()), "before": tokens_before,
            "after": tokens_after}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def compacted(response_id: str, output: list[Any], used: dict[str, Any]) -> dict[str, Any]:
    """The answer of POST /v1/responses/compact (OpenAI's compacted response object)."""
    return {"id": response_id, "object": "response.compaction", "created_at": int(time.time()), "output": output,
            "usage": used}


def response(body: Mapping[str, Any], response_id: str, output: list[Any], used: dict[str, Any] | None,
             status: str = "completed") -> dict[str, Any]:
    """A response object the gateway answers itself (a compaction_trigger's), with the request's settings."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": body.get("model"), "output": output, "usage": used, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "background": False,
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
            "service_tier": "auto", "store": body.get("store", True), "text": body.get("text"),
            "truncation": "disabled", "user": body.get("user")}


def stream(body: Mapping[str, Any], response_id: str, item: dict[str, Any], used: dict[str, Any]) -> bytes:
    """A compaction_trigger's answer as OpenAI streams it: created, in_progress, the one item added and done,
    completed (Codex reads the item from output_item.done and requires response.completed)."""
    started = response(body, response_id, [], None, "in_progress")
    kinds_and_data: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response(body, response_id, [item], used)}),
    ]
    return b"".join(events.sse(kind, {"type": kind, "sequence_number": n, **data})
                    for n, (kind, data) in enumerate(kinds_and_data))


class CompactedStream(ResponsesReader):
    """A deployment's stream after the gateway compacted its input: the compaction item comes first (added and
    done right after response.created and response.in_progress), every later event's output_index and
    sequence_number moved on to make room, the terminal response's output led by the item."""

    __slots__ = ("item", "last", "moved")
    BEFORE = frozenset({b"response.created", b"response.in_progress"})

    def __init__(self, response_id: str, item: dict[str, Any]) -> None:
        super().__init__(response_id)
        self.item = item
        self.moved = False  # the item is out: every later event is moved
        self.last = -1  # the last sequence_number sent on

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)
        if not out:
            return out
        found, rest = chat_wire.split_events(out)  # whole events, but for an over-long one passed on in pieces
        moved = b"".join(self._move(event) for event in found) + rest
        self.sequence = self.last  # a failure's error event numbers on from what the client saw
        return moved

    def _move(self, event: bytes) -> bytes:
        kind, data = events.event_type(event), events.data_of(event)
        if not self.moved and kind in self.BEFORE:
            self.last = data.get("sequence_number", self.last)
            return event
        if not data:
            return event
        head = b""
        if not self.moved:
            self.moved = True
            head = self._item_events()
        if isinstance(data.get("sequence_number"), int):
            data["sequence_number"] += 2
            self.last = data["sequence_number"]
        if isinstance(data.get("output_index"), int):
            data["output_index"] += 1
        response = data.get("response")
        if kind in TERMINAL and isinstance(response, dict):
            data["response"] = _led_by(response, self.item)
        return head + events.sse(kind.decode(), data)

    def _item_events(self) -> bytes:
        first = self.last + 1
        self.last += 2
        return b"".join(events.sse(kind, {"type": kind, "sequence_number": first + n, "output_index": 0,
                                          "item": self.item})
                        for n, kind in enumerate(("response.output_item.added", "response.output_item.done")))

    def read(self, kind: bytes, event: bytes) -> None:
        super().read(kind, event)
        if kind in TERMINAL and self.final is not None:
            self.final = _led_by(self.final, self.item)


def _led_by(response: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    output = response.get("output")
    return {**response, "output": [item, *(output if isinstance(output, list) else [])]}
