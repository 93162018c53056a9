"""The Anthropic Messages API as the gateway reads and writes it: checks, the chat view (tool_use, tool_result and
is_error), upstream body, usage with cached input, the stream reader on streams captured from vLLM 0.32, and
errors in Anthropic's envelope as the anthropic SDK reads them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway import errors
from gateway.agents.steps import read_step
from gateway.apis import events
from gateway.apis.messages import wire as messages
from gateway.apis.messages.wire import MessagesReader
from gateway.apis.usage import Usage
from gateway.errors import BadRequest, GatewayError
from gateway.features import count_tokens, extract, load_encoding

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "captured"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
# A Claude Code-like step: system blocks, the ask, a tool_use, its failed result beside a reminder.
STEP = {
    "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
    "thinking": {"type": "enabled", "budget_tokens": 4000}, "context_management": {"edits": []},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should call it", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "upstream 503"}]},
                                     {"type": "text", "text": "<system-reminder>todo list empty</system-reminder>"}]},
    ],
}


def _captured(name: str) -> bytes:
    return (CAPTURED / name).read_bytes()


def _relay(reader: MessagesReader, raw: bytes, piece: int = 5) -> bytes:
    return b"".join(reader.feed(raw[i:i + piece]) for i in range(0, len(raw), piece))


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 5, "messages": []}, "model"),
    ({"model": "m", "max_tokens": 5}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": []}, "max_tokens"),
    ({"model": "m", "max_tokens": "5", "messages": []}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "max_tokens": 5, "messages": [], "system": 3}, "system"),
    ({"model": "m", "max_tokens": 5, "messages": [], "stream": 1}, "stream"),
    ({"model": "m", "max_tokens": 5, "messages": [], "tools": "all"}, "tools"),
])
def test_check_names_the_field_the_gateway_reads_with_a_wrong_type(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        messages.check(body)
    assert raised.value.param == param and param in raised.value.message


def test_count_tokens_takes_no_cap_and_unknown_fields_pass() -> None:
    messages.check({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, count_tokens=True)
    messages.check({**STEP, "metadata": {"user_id": "u"}, "anthropic_vendor_field": [1]})


def test_the_chat_view_is_what_features_and_the_agent_step_read() -> None:
    chat = messages.view(STEP)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user", "tool"]
    assert chat["messages"][2]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    assert chat["messages"][2]["content"] == [{"type": "text", "text": "Let me look."}]
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "toolu_1", "is_error": True,
                                   "content": [{"type": "text", "text": "upstream 503"}]}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "web_search"]
    features = extract(chat, "chat")
    assert (features.tools_count, features.tool_result_turns, features.max_tokens) == (2, 1, 32000)
    assert features.stream
    assert features.system_tokens == count_tokens("You are Claude Code.")
    step = read_step(chat)
    # the reminder beside the result does not make it a new user turn; "503" alone is no error word: is_error is
    # the one signal (steps.py honours it with the one-line change in the report)
    assert step is not None and (step.step, step.turn) == (2, "tool_result")


def test_a_string_content_and_a_plain_user_turn() -> None:
    chat = messages.view({"model": "m", "max_tokens": 5, "system": "Be brief.",
                          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    step = read_step(chat)
    assert step is not None and step.turn == "user" and not step.tool_error


def test_a_hostile_body_costs_bounded_time_and_never_raises() -> None:
    turn = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}] * 100}]
    deep: Any = 1
    for _ in range(900):
        deep = [deep]
    bodies = [{"model": "m", "max_tokens": 5, "messages": turn * 50_000},
              {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}] * 100_000,
               "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                             "input": {"deep": deep}}]}]}]
    load_encoding()  # once per process: not the cost of a request
    started = time.perf_counter()
    for body in bodies:
        messages.check(body)
        chat = messages.view(body)
        extract(chat, "chat")
        read_step(chat)
    elapsed_s = time.perf_counter() - started
    assert len(messages.view(bodies[0])["messages"]) == events.MAX_VIEW_ITEMS
    assert len(messages.view(bodies[1])["messages"][0]["content"]) == events.MAX_PARTS
    assert elapsed_s < 0.5, elapsed_s


def test_the_upstream_body_rewrites_the_model_and_caps_only_when_told() -> None:
    raw, client_wants_usage = messages.upstream_body(STEP, "tiny-fast", 2000)
    sent = json.loads(raw)
    assert (sent["model"], sent["max_tokens"], client_wants_usage) == ("tiny-fast", 2000, True)
    assert sent["thinking"] == STEP["thinking"] and sent["messages"] == STEP["messages"]
    assert json.loads(messages.upstream_body(STEP, "tiny-hq")[0])["max_tokens"] == 32000
    assert STEP["model"] == "claude-sonnet-4-5"


def test_usage_counts_cached_input_in_the_prompt() -> None:
    assert messages.usage_of(json.loads(_captured("messages.json"))) == Usage(15, 16)
    cached = {"usage": {"input_tokens": 10, "cache_read_input_tokens": 9000, "cache_creation_input_tokens": 500,
                        "output_tokens": 7}}
    assert messages.usage_of(cached) == Usage(9510, 7, cached_tokens=9000, cached_reported=True)
    assert messages.usage_of({"content": []}) is None


def test_the_answer_view_holds_the_tool_use_blocks() -> None:
    answer = {"content": [{"type": "text", "text": "Checking."},
                          {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Oslo"}}]}
    message = messages.answer_view(answer)["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}


@pytest.mark.parametrize("name", ["messages_stream.sse", "messages_tool_stream.sse"])
def test_the_reader_relays_a_captured_stream_unchanged_and_reads_its_usage_and_end(name: str) -> None:
    raw = _captured(name)
    reader = MessagesReader()
    assert _relay(reader, raw) == raw
    data = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    delta = next(d for d in data if d["type"] == "message_delta")
    assert reader.done and reader.model == "tiny-fast" and not reader.error
    assert reader.usage == Usage(delta["usage"]["input_tokens"], delta["usage"]["output_tokens"])


def test_message_delta_counts_output_and_message_start_the_prompt() -> None:
    reader = MessagesReader()
    start = {"type": "message_start", "message": {"model": "claude", "usage": {
        "input_tokens": 3, "cache_read_input_tokens": 100, "output_tokens": 1}}}
    reader.feed(events.sse("message_start", start))
    assert reader.usage is None and not reader.done  # no final count yet
    reader.feed(events.sse("message_delta", {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 42}}))
    reader.feed(events.sse("message_stop", {"type": "message_stop"}))
    assert reader.usage == Usage(103, 42, cached_tokens=100, cached_reported=True) and reader.done


def test_a_cut_stream_is_not_done_and_its_tool_input_is_counted_and_kept_for_the_agent_step() -> None:
    raw = _captured("messages_tool_stream.sse")
    cut = raw[: raw.index(b"event: content_block_stop")]
    reader = MessagesReader()
    _relay(reader, cut)
    assert not reader.done and reader.usage is None  # charged from what it streamed, not as 0 tokens out
    parts = [json.loads(line[6:])["delta"]["partial_json"] for line in cut.split(b"\n") if b"partial_json" in line]
    assert reader.streamed.completion_tokens(count_tokens) == count_tokens("get_weather" + "".join(parts))
    (call,) = reader.answer_view()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": "".join(parts)}


@pytest.mark.parametrize(("err", "kind"), [
    (errors.BadRequest("bad"), "invalid_request_error"), (errors.ContextTooLong("long"), "invalid_request_error"),
    (errors.Unauthorized("who"), "authentication_error"), (errors.Forbidden("no"), "permission_error"),
    (errors.ModelNotFound("which"), "not_found_error"), (errors.PayloadTooLarge("big"), "request_too_large"),
    (errors.RateLimited("slow", retry_after_s=2), "rate_limit_error"), (errors.UpstreamError("up"), "api_error"),
    (errors.NoHealthyDeployment("none"), "overloaded_error"), (errors.StoreUnavailable("st"), "overloaded_error"),
    (errors.UpstreamTimeout("late"), "timeout_error"), (errors.GatewayError("oops"), "api_error"),
])
def test_errors_use_anthropics_envelope_and_types(err: GatewayError, kind: str) -> None:
    assert messages.envelope(err) == {"type": "error", "error": {"type": kind, "message": err.message}}


def test_the_anthropic_sdk_raises_the_error_event_after_the_first_byte() -> None:
    import anthropic
    import httpx

    raw = _captured("messages_stream.sse")
    reader = MessagesReader()
    sent = _relay(reader, raw[: raw.index(b"event: content_block_stop")])
    sent += reader.error_event(errors.UpstreamError("dropped"))
    client = anthropic.Anthropic(api_key="k", base_url="http://gateway.invalid")
    response = httpx.Response(200, content=sent, headers={"content-type": "text/event-stream"},
                              request=httpx.Request("POST", "http://gateway.invalid/v1/messages"))
    stream = anthropic.Stream(cast_to=anthropic.types.RawMessageStreamEvent, response=response, client=client)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        for event in stream:
            seen.append(event.type)
    assert seen[0] == "message_start" and "content_block_delta" in seen
    assert raised.value.body == {"type": "error", "error": {"type": "api_error", "message": "dropped"}}
