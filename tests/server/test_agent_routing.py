"""An agent's loop through the gateway with the default policy's rules: plan on hq, routine tool steps on
fast, escalate on a failing tool or a repeated call, back to fast once it recovers; the pin does not
keep the loop on hq."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.cli import explain, simulate
from gateway.policy import model as policy_module
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack

DEFAULT = yaml.safe_load((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
RULES = yaml.safe_dump({"rules": DEFAULT["rules"]})
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
SESSION = {"x-session-id": "agent-run-1"}


def _call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def _result(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


async def test_an_agent_loop_goes_where_each_deployment_is_for(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES, extra="sessions: {pin: true}\n")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find me a flight to Lisbon."}]
    served: list[tuple[str, str]] = []

    async def step() -> None:
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="auto", messages=messages, tools=TOOLS, extra_headers=SESSION)  # type: ignore[arg-type]
        served.append((raw.headers["x-gateway-deployment"], raw.headers["x-gateway-rule"]))

    await step()  # planning: a new user turn
    messages += [_call("search", {"q": "LIS"}, "1"), _result('{"flights": 3}', "1")]
    await step()  # a routine tool step
    messages += [_call("book", {"flight": 1}, "2"), _result("Error: seat map unavailable", "2")]
    await step()  # the tool failed: escalate
    messages += [_call("book", {"flight": 2}, "3"), _result('{"booked": true}', "3")]
    await step()  # recovered
    for i in range(3):
        messages += [_call("status", {"booking": 7}, f"s{i}"), _result('{"pending": true}', f"s{i}")]
    await step()  # the same call three times in a row: escalate
    assert served == [
        ("hq", "planning-to-hq"),
        ("fast", "routine-tool-step-to-fast"),  # the session is pinned to hq, the trajectory rule wins
        ("hq", "tool-error-to-hq"),
        ("fast", "routine-tool-step-to-fast"),
        ("hq", "repeated-call-to-hq"),
    ]


async def test_offline_explain_admin_explain_and_simulate_decide_what_the_live_gateway_decided(
    make_stack: Any, tmp_path: Path
) -> None:
    """Every way to ask the policy about an agent step (the `policy explain` CLI on the body, `POST /admin/explain`,
    `policy simulate` over the request log) reads the step as the live gateway does, and decides the same."""
    log_path = tmp_path / "requests.jsonl"
    stack: Stack = await make_stack(rules=RULES, settings={"request_log": str(log_path)})
    policy = policy_module.load(str(stack.policy_path))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find me a flight to Lisbon."}]
    steps = [[], [_call("search", {"q": "LIS"}, "1"), _result('{"flights": 3}', "1")],
             [_call("book", {"flight": 1}, "2"), _result("Error: seat map unavailable", "2")],
             [_call("status", {"booking": 7}, "s0"), _result('{"pending": true}', "s0")] * 3]
    live, offline, dry = [], [], []
    for added in steps:
        messages += added
        body = {"model": "auto", "messages": messages, "tools": TOOLS}
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                extra_headers=SESSION, **body)  # type: ignore[call-overload]
        live.append((raw.headers["x-gateway-deployment"], raw.headers["x-gateway-rule"]))
        request = tmp_path / "request.json"
        request.write_text(json.dumps(body))
        report = explain.offline(str(stack.policy_path), str(request), "chat",
                                 [f"x-session-id:{SESSION['x-session-id']}"], None, [])
        offline.append((report["deployment"], report["rule"]))
        async with aiohttp.ClientSession() as http, http.post(
                stack.gateway.make_url("/admin/explain"), json=body,
                headers={**SESSION, "authorization": f"Bearer {ADMIN_TOKEN}"}) as answer:
            found = await answer.json()
        dry.append((found["deployment"], found["rule"]))
    assert [d for d, _ in live] == ["hq", "fast", "hq", "hq"]  # planning, routine, tool error, repeated call
    assert offline == live
    assert dry == live
    # The log file appears with its first line, written off the request path: not there yet is not yet.
    await until(lambda: log_path.read_text().count("\n") == len(steps), what="every step's line in the request log",
                tolerate=(FileNotFoundError,))
    replayed = simulate.replay(str(log_path), policy, policy)
    assert replayed["requests"] == len(steps) and replayed["changed"] == 0
    assert replayed["tallies"]["live"]["shares"] == {"hq": 3, "fast": 1}


DEEP_ARGS = '{"a":' * 5000 + "1" + "}" * 5000  # valid JSON text, too deep for Python's parser
MALFORMED = {
    "tool_calls is a number": {"role": "assistant", "content": None, "tool_calls": 5},
    "tool_calls holds no objects": {"role": "assistant", "content": None, "tool_calls": [5, "x", None, []]},
    "function is a string": {"role": "assistant", "content": None, "tool_calls": [{"function": "search"}]},
    "arguments nest 5,000 deep": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "search", "arguments": DEEP_ARGS}}]},
    "arguments are an object": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "search", "arguments": {"q": [1, {"r": None}]}}}]},
}


async def test_malformed_tool_calls_are_read_by_the_default_rules_and_explain_without_a_500(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES)
    base = str(stack.gateway.make_url("")).rstrip("/")
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json", **SESSION}
    async with aiohttp.ClientSession() as http:
        for what, assistant in MALFORMED.items():
            body = {"model": "auto", "tools": TOOLS, "messages": [{"role": "user", "content": "go"}, assistant,
                                                  _result("Error: boom", "1")]}
            for path in ("/v1/chat/completions", "/admin/explain"):
                async with http.post(base + path, data=json.dumps(body), headers=headers) as resp:
                    assert resp.status == 200, (what, path, await resp.text())
                    if path == "/admin/explain":  # the tool error fed back is still read
                        assert (await resp.json())["rule"] == "tool-error-to-hq", what


def test_policy_explain_reads_the_agents_apis_as_it_reads_chat(tmp_path: Path) -> None:
    """A routine tool-result step in the Responses and in the Messages API is read as the same chat step."""
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
    responses_body = {"model": "auto", "instructions": "You are a coding agent.", "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}}], "input": [
        {"role": "user", "content": "List the files."},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "README.md setup.py"}]}
    messages_body = {"model": "auto", "max_tokens": 64, "system": "You are a coding agent.", "tools": [
        {"name": "Bash", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "README.md setup.py"}]}]}
    decided = []
    for endpoint, body in (("responses", responses_body), ("messages", messages_body)):
        request = tmp_path / f"{endpoint}.json"
        request.write_text(json.dumps(body))
        report = explain.offline(str(policy_path), str(request), endpoint, [], None, [])
        decided.append((report["deployment"], report["rule"]))
    assert decided == [("fast", "routine-tool-step-to-fast")] * 2
