"""An agent session through the gateway with the switch price: it stays on the deployment holding its prefix
cache across steps where the rules alone flapped, and moves when the rule's reason outweighs the price."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.server.session_caches import SessionCaches
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric

DEFAULT = yaml.safe_load((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
RULES = yaml.safe_dump({"rules": DEFAULT["rules"]})
SWITCH = yaml.safe_dump({"switch": DEFAULT["switch"]})
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def prompt_tokens(body: dict[str, Any]) -> int:
    """The fake deployments' count of a prompt: about four characters a token, as the tokenizers count code."""
    return len(json.dumps(body["messages"])) // 4


async def run(stack: Stack, outputs: list[str], session: str, ids: list[str] | None = None) -> list[str]:
    """One agent session: a task, then a tool call and its output per step; the deployment of each step (and in
    `ids` the gateway's request id of each)."""
    stack.hq.prompt_tokens = stack.fast.prompt_tokens = prompt_tokens
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    served = []
    for n, output in enumerate(["", *outputs]):
        if n:
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": n})}}]},
                {"role": "tool", "tool_call_id": f"c{n}", "content": output}]
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="auto", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                extra_headers={"x-session-id": session})
        served.append(raw.headers["x-gateway-deployment"])
        if ids is not None:
            ids.append(raw.headers["x-request-id"])
    return served


# Large tool outputs (about 2,000 tokens each), failing on steps 5 and 8: late in the session, where hq has not
# seen most of the conversation.
LONG = ["x" * 8_000 + f"\n[Command finished with exit code {int(n in (5, 8))}]" for n in range(1, 10)]


async def test_a_session_stays_on_its_cache_where_the_rules_alone_flapped(make_stack: Any) -> None:
    without = await make_stack(rules=RULES)
    assert await run(without, LONG, "old") == [
        "hq", "fast", "fast", "fast", "fast", "hq", "fast", "fast", "hq", "fast"]
    stack: Stack = await make_stack(rules=RULES, extra=SWITCH)
    ids: list[str] = []
    served = await run(stack, LONG, "new", ids)
    # the plan on hq, one step more (min_stay_steps), then fast for good: each later error would make hq prefill
    # ~10-16k tokens it never saw for a reason worth 100 ms
    assert served == ["hq", "hq", "fast", "fast", "fast", "fast", "fast", "fast", "fast", "fast"]
    explained = await explain(stack, ids[5])
    assert any(line.startswith("switch: stays on fast: hq would prefill ") for line in explained), explained
    assert await metric(stack.gateway, "gateway_session_switches_total", from_deployment="hq",
                        to_deployment="fast") == 1
    assert await metric(stack.gateway, "gateway_session_switches_total", from_deployment="fast") == 0
    prefilled = await metric(stack.gateway, "gateway_session_cache_predicted_tokens_total", kind="uncached")
    cached = await metric(stack.gateway, "gateway_session_cache_predicted_tokens_total", kind="cached")
    assert cached > 3 * prefilled > 0


async def test_a_session_moves_when_the_reason_outweighs_the_price(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=SWITCH)
    short = ["ok", "ok", "ok", "Traceback (most recent call last):\nValueError: bad input in parser.py", "ok", "ok"]
    ids: list[str] = []
    # the error on step 4 comes while hq lacks only a few hundred tokens: it escalates, and after its stay
    # the session goes back to fast, which lacks only what hq served
    assert await run(stack, short, "short", ids) == ["hq", "hq", "fast", "fast", "hq", "hq", "fast"]
    explained = await explain(stack, ids[4])
    assert any(line.startswith("switch: moves to hq: hq would prefill ") for line in explained), explained


async def test_a_fault_in_the_served_steps_record_does_not_cost_the_client_its_answer(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What a served step leaves in the session's record is noted once its answer is written: a bug there is
    logged, and the client still gets the answer the deployment generated (and the tenant is charged for)."""
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in the record of a served step")

    monkeypatch.setattr(SessionCaches, "served", broken)
    stack: Stack = await make_stack(rules=RULES, extra=SWITCH)
    assert len(await run(stack, ["ok", "ok"], "faulty")) == 3  # each step answered (a 500 would raise)
    assert await metric(stack.gateway, "gateway_requests_total", status="200") == 3
    await until(lambda: "a bug in the record of a served step" in caplog.text, what="the bug logged")


async def explain(stack: Stack, request_id: str) -> list[str]:
    """The decision trail of a request, as /admin/requests/{id}/explain recomputes it."""
    async def found() -> list[str] | None:
        async with aiohttp.ClientSession() as http, http.get(
                stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            body = await resp.json()
        return body.get("reasons") if resp.status == 200 else None
    reasons: list[str] = await until(found, what=f"the explanation of {request_id}")
    return reasons


async def test_a_step_with_a_lone_surrogate_in_its_parts_is_hashed_and_served(make_stack: Any) -> None:
    """json reads "\\ud83d" as a lone surrogate where msgspec refuses it: the prompt's chain hashes such a
    content of parts too, rather than failing the step."""
    stack: Stack = await make_stack(rules=RULES, extra=SWITCH)
    raw = '{"model": "auto", "messages": [{"role": "user", "content": [{"type": "text", "text": "half \\ud83d"}]}]}'
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", data=raw.encode(),
                             headers={"content-type": "application/json", "x-session-id": "surrogates-1"}) as resp:
            assert resp.status == 200, await resp.text()
