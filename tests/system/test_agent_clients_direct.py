"""Real agent clients against the fake vLLM's Responses and Messages APIs, with no gateway in between.

They prove the clients and the fake speak each other's wire formats: the official `openai` and `anthropic` SDKs
parse what the fake streams, the OpenAI Agents SDK runs an agent with a function tool to its final output, and
Codex CLI and Claude Code each run a scripted tool call on this machine and continue with its result. Pointed
at the gateway instead of the fake (tests/fixtures/agent_clients.py takes any base URL), the same runs are the
end-to-end tests of the gateway's adapters.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import PROMPT_TOKENS, FakeVLLM, Fault, ToolUse
from tests.fixtures import agent_clients
from tests.fixtures.conditions import wait_until

CAPTURED = Path(__file__).resolve().parents[1] / "fixtures" / "captured"
MODEL = "fake-fast"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
async def fake(aiohttp_server: Callable[..., Any]) -> tuple[FakeVLLM, TestServer]:
    model = FakeVLLM(MODEL)
    return model, await aiohttp_server(model.app())


def _root(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


# --- the SDKs parse the fake's wire formats ---


async def test_openai_responses_streamed_and_not_call_the_tool_then_answer(fake: tuple[FakeVLLM, TestServer]) -> None:
    model, server = fake
    client = openai.AsyncOpenAI(base_url=_root(server) + "/v1", api_key="none", max_retries=0)
    first = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])  # type: ignore[list-item]
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert first.usage is not None and first.usage.input_tokens == PROMPT_TOKENS
    items: Any = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    stream = await client.responses.create(model=MODEL, input=items, tools=[WEATHER], stream=True)  # type: ignore[list-item]
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == " ".join(["tok"] * model.chunks)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.usage is not None and final.usage.output_tokens == model.chunks
    assert model.paths == ["/v1/responses", "/v1/responses"]
    await client.close()


async def test_anthropic_messages_stream_a_tool_use_and_count_tokens(fake: tuple[FakeVLLM, TestServer]) -> None:
    model, server = fake
    model.script = [ToolUse("Read", {"file_path": "/tmp/notes.txt"})]
    client = anthropic.AsyncAnthropic(base_url=_root(server), api_key="none", max_retries=0)
    tools: Any = [{"name": "Read", "description": "Read a file.",
                   "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
    messages: Any = [{"role": "user", "content": "Read my notes."}]
    async with client.messages.stream(model=MODEL, max_tokens=32000, messages=messages, tools=tools) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason == "tool_use"
    use = message.content[0]
    assert use.type == "tool_use" and use.name == "Read" and use.input == {"file_path": "/tmp/notes.txt"}
    assert (message.usage.input_tokens, message.usage.output_tokens) == (PROMPT_TOKENS, model.chunks)
    messages += [{"role": "assistant", "content": [use.model_dump()]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
    answer = await client.messages.create(model=MODEL, max_tokens=100, messages=messages, tools=tools)
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
    counted = await client.messages.count_tokens(model=MODEL, messages=messages, tools=tools)
    assert counted.input_tokens == PROMPT_TOKENS
    assert model.paths == ["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"]
    await client.close()


def _event_types(sse: str) -> list[str]:
    """The stream's event types in order, a run of one type (the deltas) counted once."""
    types = [line.removeprefix("event: ") for line in sse.splitlines() if line.startswith("event: ")]
    return [kind for kind, _ in itertools.groupby(types)]


def _data(sse: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in sse.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(("path", "body", "captured"), [
    ("/v1/responses", {"input": "hi"}, "responses_stream.sse"),
    ("/v1/responses", {"input": "hi", "tools": [WEATHER]}, "responses_tool_stream.sse"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, "messages_stream.sse"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "tools": [
        {"name": "get_weather", "input_schema": WEATHER["parameters"]}]}, "messages_tool_stream.sse"),
])
async def test_the_fake_streams_what_vllm_streams(
    fake: tuple[FakeVLLM, TestServer], path: str, body: dict[str, Any], captured: str
) -> None:
    """Event for event (types, order, the fields each carries) as vLLM 0.32 streamed it (tests/fixtures/captured)."""
    _, server = fake
    async with aiohttp.ClientSession() as session, session.post(
            f"{_root(server)}{path}", json={"model": MODEL, "stream": True, **body}) as answer:
        streamed = (await answer.read()).decode()
    vllm = (CAPTURED / captured).read_text()
    assert _event_types(streamed) == _event_types(vllm)
    by_type = {event["type"]: set(event) for event in _data(vllm)}
    for event in _data(streamed):
        assert set(event) >= by_type[event["type"]] - {"logprobs"}, event


async def test_faults_answer_in_each_apis_envelope(fake: tuple[FakeVLLM, TestServer]) -> None:
    model, server = fake
    model.faults = [Fault(status=503, message="overloaded"), Fault(status=503, message="overloaded")]
    claude = anthropic.AsyncAnthropic(base_url=_root(server), api_key="none", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body == {"type": "error", "error": {"type": "server_error", "message": "overloaded"}}
    codex = openai.AsyncOpenAI(base_url=_root(server) + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        await codex.responses.create(model=MODEL, input="hi")
    assert failed.value.body == {"message": "overloaded", "type": "server_error"}
    await claude.close()
    await codex.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_agents_sdk_runs_an_agent_with_a_function_tool_to_its_final_output(
    fake: tuple[FakeVLLM, TestServer], stream: bool
) -> None:
    model, server = fake
    model.tool_args = lambda n: {"city": "Lisbon"}
    run = await agent_clients.agents_sdk_run(_root(server) + "/v1", "Weather in Lisbon?", model=MODEL, stream=stream)
    assert run.tool_outputs == ["sunny in Lisbon"]
    assert run.final_output.strip() == " ".join(["tok"] * model.chunks)
    outputs = [item for item in model.received[-1]["input"] if item.get("type") == "function_call_output"]
    assert [item["output"] for item in outputs] == ["sunny in Lisbon"]  # what the tool returned went back


# --- the coding agents: a scripted tool call, run for real, and the turn continues ---


async def test_codex_runs_a_scripted_shell_command_and_continues(
    fake: tuple[FakeVLLM, TestServer], tmp_path: Path
) -> None:
    model, server = fake
    model.script = [ToolUse("exec_command", {"cmd": "echo clue-$((6 * 7))"}), "Done: the clue is clue-42."]
    run = await agent_clients.codex_exec(_root(server) + "/v1", "Print the clue.", tmp_path, model=MODEL)
    assert run.exit_code == 0, run.describe()
    assert model.paths == ["/v1/responses", "/v1/responses"]
    first, second = model.received
    assert first["stream"] is True and "exec_command" in [t.get("name") for t in first["tools"]]
    results = [item for item in second["input"] if item.get("type") == "function_call_output"]
    assert len(results) == 1 and "clue-42" in json.dumps(results[0]["output"])  # the command ran here
    messages = [e["item"]["text"] for e in run.events() if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages == ["Done: the clue is clue-42."]
    headers = model.headers_seen[0]
    assert headers["session-id"] == json.loads(headers["x-codex-turn-metadata"])["session_id"]


async def test_claude_code_runs_scripted_tools_and_continues(
    fake: tuple[FakeVLLM, TestServer], tmp_path: Path
) -> None:
    model, server = fake
    notes = tmp_path / "work" / "notes.txt"
    model.script = [ToolUse("Bash", {"command": "echo clue-$((6 * 7))", "description": "Print the clue"}),
                    ToolUse("Read", {"file_path": str(notes)}), "Done: clue-42, and the notes say 42."]
    run = await agent_clients.claude_print(_root(server), "Print the clue, then read notes.txt.", tmp_path, model=MODEL)
    assert run.exit_code == 0, run.describe()
    steps = [body for path, body in zip(model.paths, model.received, strict=True) if path == "/v1/messages"]
    assert len(steps) == 3
    assert steps[0]["stream"] is True and {"Bash", "Read"} <= {t.get("name") for t in steps[0]["tools"]}
    results = [block for body in steps[1:] for block in body["messages"][-1]["content"]
               if isinstance(block, dict) and block.get("type") == "tool_result"]
    assert len(results) == 2 and not any(block.get("is_error") for block in results), results
    assert "clue-42" in json.dumps(results[0]["content"])  # Bash ran here
    assert "The answer is 42." in json.dumps(results[1]["content"])  # Read read the file
    final = [e for e in run.events() if e.get("type") == "result"]
    assert final and final[0]["result"] == "Done: clue-42, and the notes say 42."
    headers = model.headers_seen[model.paths.index("/v1/messages")]
    assert headers["x-api-key"] == "none" and headers["X-Claude-Code-Session-Id"] == final[0]["session_id"]


async def test_a_client_past_its_timeout_is_killed_with_every_process_it_started(tmp_path: Path) -> None:
    """`codex` is a node wrapper around a native binary: killing only the wrapper left the binary holding the
    pipes (and its deployment busy) until it ended on its own, and the run with it."""
    pid_file = tmp_path / "child.pid"
    script = f"sleep 3600 & echo $! > {pid_file}; echo started; wait"
    # 10 s: time for the shell to start its child and say so before the kill, on a loaded machine too
    run = await agent_clients.run(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, tmp_path, timeout_s=10.0)
    assert run.exit_code == -9 and run.stdout == "started\n"
    assert run.seconds < 60, run.describe()  # the child's hour, had it kept the pipes open
    child = int(pid_file.read_text())

    def gone() -> bool:  # SIGKILL is delivered, not awaited: the child may still be running for a moment
        stat = Path(f"/proc/{child}/stat")
        return not stat.exists() or stat.read_text().split()[2] == "Z"

    wait_until(gone, 10.0, tolerate=(OSError,))
