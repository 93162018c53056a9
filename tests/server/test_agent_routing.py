"""An agent's loop through the gateway with the default policy's rules: plan on hq, routine tool steps on
fast, escalate on a failing tool or a repeated call, back to fast once it recovers; the pin does not
keep the loop on hq."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.stack import Stack

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
