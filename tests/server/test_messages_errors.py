"""Every error on /v1/messages reaches the client in Anthropic's envelope (issue 32, item 3): the gateway's own
checks, a deployment's error answers (vLLM's request validation answers in OpenAI's envelope), and a stream that
fails after its first byte. The real `anthropic` SDK against a real gateway in front of the fake vLLM."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import pytest

from fakes.faulty_vllm import Fault
from tests.fixtures.stack import Stack

TOOLS: Any = [{"name": "Read", "description": "Read a file.",
               "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
ASK: Any = [{"role": "user", "content": "Read my notes."}]
USE = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/tmp/notes.txt"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}
VLLM_SAYS = "1 validation error:\n  {'type': 'dict_type', 'loc': ('body', 'messages', 1, 'content', 0, 'input')}"


def _client(stack: Stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_deployments_400_is_the_sdks_bad_request_error_with_the_deployments_message(
    stack: Stack, stream: bool
) -> None:
    stack.fast.faults.append(Fault(status=400, message=VLLM_SAYS, validation=True))  # OpenAI's envelope, as vLLM
    async with _client(stack) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            if stream:
                async with client.messages.stream(model="fast", max_tokens=64, messages=ASK, tools=TOOLS) as events:
                    await events.get_final_message()
            else:
                await client.messages.create(model="fast", max_tokens=64, messages=ASK, tools=TOOLS)
    assert raised.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": VLLM_SAYS}}
    assert raised.value.message.endswith(str(raised.value.body))
    assert len(stack.fast.received) == 1  # the deployment's answer, not a gateway refusal


@pytest.mark.parametrize(("status", "error_class", "kind"), [
    (404, anthropic.NotFoundError, "not_found_error"),
    (422, anthropic.UnprocessableEntityError, "invalid_request_error"),
    (429, anthropic.RateLimitError, "rate_limit_error"),
])
async def test_a_deployments_error_answer_takes_anthropics_type_for_its_status(
    stack: Stack, status: int, error_class: type[anthropic.APIStatusError], kind: str
) -> None:
    stack.fast.faults.append(Fault(status=status, message="refused by the deployment"))
    async with _client(stack) as client:
        with pytest.raises(error_class) as raised:
            await client.messages.create(model="fast", max_tokens=64, messages=ASK)
    assert raised.value.status_code == status
    assert raised.value.body == {"type": "error", "error": {"type": kind, "message": "refused by the deployment"}}


async def test_a_deployments_error_event_mid_stream_becomes_one_anthropic_error_event(stack: Stack) -> None:
    stack.fast.faults.append(Fault(error_after_chunks=3, message="EngineCore died"))
    async with _client(stack) as client:
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with client.messages.stream(model="fast", max_tokens=64, messages=ASK) as events:
                async for event in events:
                    seen.append(event.type)
    assert seen[0] == "message_start" and "content_block_delta" in seen
    body: Any = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("Deployment 'fast' reported an error mid-stream")

    stack.fast.faults.append(Fault(error_after_chunks=3, message="EngineCore died"))
    body = {"model": "fast", "max_tokens": 64, "messages": ASK, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(f"{stack.gateway_root}/v1/messages", json=body) as resp:
        streamed = (await resp.read()).decode()
    assert streamed.count("event: error") == 1 and "internal_error" not in streamed  # vLLM's own is withheld


@pytest.mark.parametrize(("messages", "said"), [
    ([*ASK, {"role": "assistant", "content": [USE]},
      {"role": "user", "content": [{"type": "tool_result", "content": "42"}]}],
     "messages.2.content.0.tool_result.tool_use_id: Field required"),
    ([*ASK, {"role": "assistant", "content": [{**USE, "input": '{"file_path": "/tmp/notes.txt"}'}]},
      {"role": "user", "content": [RESULT]}],
     "messages.1.content.0.tool_use.input: Input should be a valid dictionary"),
    ([*ASK, {"role": "assistant", "content": [USE]}, {"role": "user", "content": [{**RESULT, "tool_use_id": "x"}]}],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1"),
    ([*ASK, {"role": "assistant", "content": "Let me look."}, {"role": "user", "content": [RESULT]}],
     "messages.2.content: unexpected `tool_use_id` found in `tool_result` blocks: toolu_1"),
    ([{"role": "user", "content": [USE]}],
     "messages.0.content.0: a `tool_use` block belongs in an `assistant` turn, not a `user` one"),
])
async def test_a_request_anthropics_api_refuses_is_refused_in_its_envelope_before_any_deployment(
    stack: Stack, messages: Any, said: str
) -> None:
    async with _client(stack) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.messages.create(model="fast", max_tokens=64, messages=messages, tools=TOOLS)
    body: Any = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(said)
    assert stack.fast.received == [] and stack.hq.received == []


async def test_a_well_formed_tool_round_trip_still_passes(stack: Stack) -> None:
    messages: Any = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, USE]},
                     {"role": "user", "content": [RESULT, {"type": "text", "text": "<system-reminder/>"}]}]
    async with _client(stack) as client:
        answer = await client.messages.create(model="fast", max_tokens=64, messages=messages, tools=TOOLS)
    assert answer.stop_reason == "end_turn"


async def test_a_path_or_method_the_gateway_does_not_serve_under_v1_messages_is_refused_in_anthropics_envelope(
    stack: Stack
) -> None:
    async with _client(stack) as client:
        with pytest.raises(anthropic.NotFoundError) as raised:
            await client.messages.batches.create(requests=[])
    body: Any = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    async with aiohttp.ClientSession() as http, http.get(f"{stack.gateway_root}/v1/messages") as resp:
        assert resp.status == 405 and (await resp.json())["type"] == "error"
    async with aiohttp.ClientSession() as http, http.get(f"{stack.gateway_root}/v1/nothing") as resp:
        assert resp.status == 404 and "type" not in await resp.json()  # the gateway's own paths: OpenAI's
