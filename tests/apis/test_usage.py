"""Each API's usage as the gateway reads it, with the prompt's cached tokens: streamed and not, absent,
garbled, and a deployment that claims more cached tokens than the prompt had."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis import events
from gateway.apis.chat import wire as chat_wire
from gateway.apis.chat.adapter import CHAT, COMPLETIONS
from gateway.apis.messages import wire as messages
from gateway.apis.messages.wire import MessagesReader
from gateway.apis.responses import wire as responses
from gateway.apis.responses.wire import ResponsesReader
from gateway.apis.usage import Usage

# (what the cached figure is, as sent; the usage read): the same table for every API
CACHED_FIGURES = [
    pytest.param(9000, Usage(10_000, 7, cached_tokens=9000, cached_reported=True), id="reported"),
    pytest.param(0, Usage(10_000, 7, cached_reported=True), id="none-cached"),
    pytest.param(None, Usage(10_000, 7), id="absent"),
    pytest.param("9000", Usage(10_000, 7), id="a-string"),
    pytest.param(-5, Usage(10_000, 7), id="negative"),
    pytest.param(True, Usage(10_000, 7), id="a-boolean"),
    pytest.param(12.5, Usage(10_000, 7), id="a-fraction"),
    pytest.param(25_000, Usage(10_000, 7, cached_tokens=10_000, cached_overstated=True, cached_reported=True),
                 id="more-than-the-prompt"),
]


def _openai_usage(cached: Any) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": 10_000, "completion_tokens": 7, "total_tokens": 10_007}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _responses_usage(cached: Any) -> dict[str, Any]:
    usage: dict[str, Any] = {"input_tokens": 10_000, "output_tokens": 7, "total_tokens": 10_007,
                             "output_tokens_details": {"reasoning_tokens": 0}}
    if cached is not None:
        usage["input_tokens_details"] = {"cached_tokens": cached}
    return usage


@pytest.mark.parametrize(("cached", "expected"), CACHED_FIGURES)
@pytest.mark.parametrize("adapter", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_chat_and_completions_read_prompt_tokens_details(adapter: Any, cached: Any, expected: Usage) -> None:
    answer = {"object": "chat.completion", "choices": [], "usage": _openai_usage(cached)}
    assert adapter.usage_of(answer) == expected
    # streamed: the final usage-only chunk
    reader = adapter.stream_reader(True, "")
    chunk = {"object": "chat.completion.chunk", "choices": [], "usage": _openai_usage(cached)}
    reader.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n" + chat_wire.DONE_EVENT)
    assert reader.usage == expected and reader.done


@pytest.mark.parametrize(("cached", "expected"), CACHED_FIGURES)
def test_responses_read_input_tokens_details(cached: Any, expected: Usage) -> None:
    assert responses.usage_of({"object": "response", "usage": _responses_usage(cached)}) == expected
    reader = ResponsesReader("resp_" + "a" * 48)
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_up", "model": "m"}}
    completed = {"type": "response.completed", "sequence_number": 1,
                 "response": {"id": "resp_up", "model": "m", "usage": _responses_usage(cached)}}
    reader.feed(events.sse("response.created", created) + events.sse("response.completed", completed))
    assert reader.usage == expected and reader.done


@pytest.mark.parametrize(("cached", "expected"), CACHED_FIGURES[:3])
def test_messages_read_cache_read_input_tokens_as_vllm_reports_them(cached: Any, expected: Usage) -> None:
    # vLLM's /v1/messages: input_tokens is the prompt less its cache read (as Anthropic counts them)
    usage = {"input_tokens": 10_000 - (cached or 0), "output_tokens": 7}
    if cached is not None:
        usage["cache_read_input_tokens"] = cached
    assert messages.usage_of({"type": "message", "usage": usage}) == expected
    # streamed: message_start has the prompt without its details; message_delta the final count, with them
    reader = MessagesReader()
    start = {"type": "message_start", "message": {"model": "m", "usage": {"input_tokens": 10_000,
                                                                          "output_tokens": 0}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}
    reader.feed(events.sse("message_start", start) + events.sse("message_delta", delta)
                + events.sse("message_stop", {"type": "message_stop"}))
    assert reader.usage == expected and reader.done


@pytest.mark.parametrize("cached", ["9000", -5, None, [1]])
def test_a_garbled_cache_read_is_none_cached_and_no_prompt_token(cached: Any) -> None:
    usage = {"input_tokens": 1000, "cache_read_input_tokens": cached, "output_tokens": 7}
    assert messages.usage_of({"usage": usage}) == Usage(1000, 7)


@pytest.mark.parametrize("details", [None, "garbled", [], {"cached_tokens": None}, {}])
def test_garbled_details_are_none_cached(details: Any) -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 2, "prompt_tokens_details": details}
    assert chat_wire.usage_of({"usage": usage}) == Usage(50, 2)
    assert responses.usage_of({"usage": {"input_tokens": 50, "output_tokens": 2, "input_tokens_details": details}}) \
        == Usage(50, 2)


@pytest.mark.parametrize("prompt", ["12", None, -1, 3.0])
def test_a_garbled_prompt_count_is_zero_and_any_cached_count_clamped_to_it(prompt: Any) -> None:
    usage = {"prompt_tokens": prompt, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    assert chat_wire.usage_of({"usage": usage}) == Usage(0, 2, cached_overstated=True, cached_reported=True)
