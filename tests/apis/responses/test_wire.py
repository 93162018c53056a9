"""The Responses API as the gateway reads and writes it: checks, the chat view, upstream body, usage, the stream
reader on streams captured from vLLM 0.32, and the error at the end of a failed stream as real clients read it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.agents.steps import read_step
from gateway.apis import events
from gateway.apis.responses import wire as responses
from gateway.apis.responses.wire import ResponsesReader
from gateway.apis.usage import Usage
from gateway.errors import BadRequest, RateLimited, UpstreamError
from gateway.features import count_tokens, extract, load_encoding

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "captured"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
# A Codex-like second step: instructions, the user's ask, the call the model made, its output fed back.
STEP = {
    "model": "gpt-5-codex", "instructions": "You are a coding agent.", "stream": True, "store": False,
    "tools": [WEATHER, {"type": "custom", "name": "apply_patch", "description": "Patch files",
                        "format": {"type": "grammar"}}, {"type": "web_search"}],
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ],
    "max_output_tokens": 512, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
}


def _captured(name: str) -> bytes:
    return (CAPTURED / name).read_bytes()


def _relay(reader: ResponsesReader, raw: bytes, piece: int = 7) -> bytes:
    """Feed a stream in small chunks (events split anywhere, as TCP delivers them); what the client gets."""
    return b"".join(reader.feed(raw[i:i + piece]) for i in range(0, len(raw), piece))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 3}, "input"),
    ({"model": "m", "input": ["hi"]}, "input[0]"),
    ({"model": "m", "input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "hi", "max_output_tokens": True}, "max_output_tokens"),
    ({"model": "m", "input": "hi", "stream": "yes"}, "stream"),
    ({"model": "m", "input": "hi", "instructions": ["x"]}, "instructions"),
    ({"model": "m", "input": "hi", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "m", "input": "hi", "tools": {}}, "tools"),
])
def test_check_names_the_field_the_gateway_reads_with_a_wrong_type(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        responses.check(body)
    assert raised.value.param == param and param in raised.value.message


def test_check_lets_unknown_fields_and_every_item_type_through() -> None:
    responses.check({**STEP, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
                     "reasoning": {"effort": "low"}, "vendor_extension": {"a": 1}})


def test_the_chat_view_is_what_features_and_the_agent_step_read() -> None:
    chat = responses.view(STEP)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"] == "You are a coding agent."
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "apply_patch", "web_search"]
    features = extract(chat, "chat")
    assert (features.tools_count, features.tool_result_turns, features.max_tokens) == (3, 1, 512)
    assert features.response_format == "json_schema" and features.stream and features.user_turns == 1
    assert features.system_tokens == count_tokens("You are a coding agent.")
    step = read_step(chat)
    assert step is not None
    assert (step.step, step.turn, step.tool_error, step.repeated_calls) == (2, "tool_result", False, 1)


def test_a_string_input_is_one_user_message_and_calls_in_a_row_are_one_assistant_turn() -> None:
    assert responses.view({"model": "m", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "ls", "arguments": "{}"} for i in range(3)]
    chat = responses.view({"model": "m", "input": [{"role": "user", "content": "go"}, *calls]})
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert len(chat["messages"][1]["tool_calls"]) == 3
    step = read_step(chat)
    assert step is not None and step.repeated_calls == 3


def test_a_hostile_body_costs_bounded_time_and_never_raises() -> None:
    many = {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c", "output": "x"}] * 50_000}
    deep: Any = "x"
    for _ in range(900):  # deeper than pydantic's encoder goes, within json's
        deep = {"a": deep}
    nested = {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": deep},
                                      {"role": "user", "content": [{"type": "input_text", "text": "y"}] * 10_000}]}
    load_encoding()  # once per process: not the cost of a request
    started = time.perf_counter()
    for body in (many, nested):
        responses.check(body)
        chat = responses.view(body)
        extract(chat, "chat")
        read_step(chat)
    elapsed_s = time.perf_counter() - started
    assert len(responses.view(many)["messages"]) <= events.MAX_VIEW_ITEMS
    assert len(responses.view(nested)["messages"][-1]["content"]) == events.MAX_PARTS
    assert elapsed_s < 0.5, elapsed_s


def test_the_upstream_body_rewrites_the_model_caps_and_turns_the_deployments_store_off() -> None:
    body = {**STEP, "store": True, "previous_response_id": "resp_x", "include": ["reasoning.encrypted_content"]}
    raw, client_wants_usage = responses.upstream_body(body, "tiny-fast", 100)
    sent = json.loads(raw)
    assert (sent["model"], sent["max_output_tokens"], sent["store"]) == ("tiny-fast", 100, False)
    assert client_wants_usage
    assert "previous_response_id" not in sent and sent["include"] == body["include"] and sent["input"] == STEP["input"]
    assert json.loads(responses.upstream_body(STEP, "tiny-hq")[0])["max_output_tokens"] == 512
    assert body["model"] == "gpt-5-codex"  # the client's body is not changed


def test_usage_and_the_answer_view_of_a_captured_non_streamed_answer() -> None:
    answer = json.loads(_captured("responses.json"))
    assert responses.usage_of(answer) == Usage(15, 16, cached_reported=True)  # vLLM's: 0 cached
    assert responses.usage_of({"usage": None}) is None
    view = responses.answer_view(answer)
    assert view["choices"][0]["message"]["content"] == answer["output"][0]["content"][0]["text"]
    adopted, renamed = responses.adopt_answer(_captured("responses.json"), answer, "resp_mine")
    assert json.loads(adopted)["id"] == renamed["id"] == "resp_mine" and answer["id"].encode() not in adopted
    assert json.loads(adopted) == {**answer, "id": "resp_mine"}


@pytest.mark.parametrize("name", ["responses_stream.sse", "responses_tool_stream.sse"])
def test_the_reader_relays_a_captured_stream_and_reads_its_model_usage_and_end(name: str) -> None:
    raw = _captured(name)
    reader = ResponsesReader("resp_" + "a" * 48)
    out = _relay(reader, raw)
    upstream_id = json.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    assert out == raw.replace(upstream_id.encode(), reader.response_id.encode())  # otherwise unchanged
    final = json.loads(raw.rsplit(b"data: ", 1)[1])["response"]
    assert reader.done and reader.model == "tiny-fast" and not reader.error
    assert reader.usage == Usage(final["usage"]["input_tokens"], final["usage"]["output_tokens"],
                                        cached_tokens=final["usage"]["input_tokens_details"]["cached_tokens"],
                                        cached_reported=True)
    assert reader.final is not None and reader.final["id"] == reader.response_id
    assert reader.sequence == json.loads(raw.rsplit(b"data: ", 1)[1])["sequence_number"]


def test_a_cut_stream_is_not_done_and_its_text_and_call_arguments_are_counted() -> None:
    raw = _captured("responses_tool_stream.sse")
    cut = raw[: raw.index(b"event: response.function_call_arguments.done")]
    reader = ResponsesReader(responses.new_response_id())
    _relay(reader, cut)
    assert not reader.done and reader.usage is None
    deltas = [json.loads(line[6:])["delta"] for line in cut.split(b"\n") if b'"delta"' in line]
    assert deltas and reader.streamed.completion_tokens(count_tokens) == count_tokens("get_weather" + "".join(deltas))


def test_the_tool_call_of_a_streamed_answer_reaches_the_agent_step() -> None:
    reader = ResponsesReader(responses.new_response_id())
    _relay(reader, _captured("responses_tool_stream.sse"))
    (call,) = reader.answer_view()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")


def test_ids_are_unguessable() -> None:
    ids = {responses.new_response_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("resp_") and len(i) == 5 + 48 for i in ids)


def _parsed_by_the_openai_sdk(raw: bytes) -> list[Any]:
    """The events the openai SDK makes of these bytes, as `responses.create(stream=True)` yields them."""
    import httpx
    from openai import OpenAI
    from openai.types.responses import ResponseStreamEvent

    client = OpenAI(api_key="k", base_url="http://gateway.invalid/v1")
    response = httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"},
                              request=httpx.Request("POST", "http://gateway.invalid/v1/responses"))
    from openai import Stream
    return list(Stream(cast_to=ResponseStreamEvent, response=response, client=client))


@pytest.mark.parametrize("err", [UpstreamError("Deployment 'fast' dropped the connection"),
                                 RateLimited("Tenant budget spent", retry_after_s=3)])
def test_a_failure_after_the_first_byte_ends_the_stream_as_openais_api_does(err: Any) -> None:
    raw = _captured("responses_stream.sse")
    cut = raw[: raw.index(b"event: response.output_text.done")]
    reader = ResponsesReader(responses.new_response_id())
    sent = _relay(reader, cut) + reader.error_event(err)
    parsed = _parsed_by_the_openai_sdk(sent)
    error, failed = parsed[-2:]
    assert (error.type, error.code, error.message) == ("error", err.code, err.message)
    assert failed.type == "response.failed" and failed.response.id == parsed[0].response.id == reader.response_id
    assert failed.response.status == "failed" and failed.response.error.message == err.message
    assert failed.response.error.code == ("rate_limit_exceeded" if isinstance(err, RateLimited) else "server_error")
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))


def test_a_failure_before_any_whole_event_still_names_the_response() -> None:
    reader = ResponsesReader(responses.new_response_id())
    reader.feed(b"event: response.created\ndata: {\"resp")
    failed = _parsed_by_the_openai_sdk(reader.error_event(UpstreamError("gone")))[-1]
    assert failed.response.id == reader.response_id and failed.response.status == "failed"


async def test_the_agents_sdk_stops_on_the_error_with_the_gateways_message(aiohttp_server: Any) -> None:
    from agents import Agent, Runner, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from aiohttp import web
    from openai import AsyncOpenAI

    raw = _captured("responses_stream.sse")
    reader = ResponsesReader(responses.new_response_id())
    sent = _relay(reader, raw[: raw.index(b"event: response.output_text.done")])
    sent += reader.error_event(UpstreamError("Deployment 'fast' dropped the connection"))

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sent)
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", stream)
    server = await aiohttp_server(app)
    set_tracing_disabled(True)
    client = AsyncOpenAI(api_key="k", base_url=str(server.make_url("/v1")), max_retries=0)
    agent = Agent(name="a", model=OpenAIResponsesModel("tiny-fast", client))
    result = Runner.run_streamed(agent, "hi")
    with pytest.raises(Exception, match="dropped the connection"):
        async for _ in result.stream_events():
            pass
