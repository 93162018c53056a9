"""Warm-ups through a real gateway in front of the fake pair: a step that the switch price kept on fast while its rule
wanted hq sends hq the session's prompt (max_tokens 1) after its answer; the next step finds hq warm and moves
cheaply. A live step arriving first cancels the warm-up; a deployment with requests waiting is not warmed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import yaml

from fakes.faulty_vllm import Fault
from gateway.cli.command import main
from tests.fixtures.agent_runs import admin, recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric
from tests.server.test_session_caches import DEFAULT, RULES, TOOLS, explain, prompt_tokens

WARM = yaml.safe_dump({"switch": DEFAULT["switch"]})
NO_WARM = yaml.safe_dump({"switch": {k: v for k, v in DEFAULT["switch"].items() if k != "warm"}})
# About 2,000 tokens a tool output; steps 5 and 6 fail (late: hq has not seen most of the session).
OUTPUTS = ["x" * 8_000 + f"\n[Command finished with exit code {int(n in (5, 6))}]" for n in range(1, 8)]


class Session:
    """One agent session, sent a step at a time: a task, then a tool call and its output per step."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.stack, self.name = stack, name
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        self.ids: list[str] = []
        stack.hq.prompt_tokens = stack.fast.prompt_tokens = prompt_tokens

    async def step(self, output: str | None = None) -> str:
        """The next step (with the output of the last tool call, after the first); the deployment that served it."""
        n = len(self.ids)
        if n:
            self.messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": n})}}]},
                {"role": "tool", "tool_call_id": f"c{n}", "content": output}]
        async with self.stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="auto", messages=self.messages, tools=TOOLS,  # type: ignore[arg-type]
                extra_headers={"x-session-id": self.name})
        self.ids.append(raw.headers["x-request-id"])
        return raw.headers["x-gateway-deployment"]

    async def steps(self, count: int) -> list[str]:
        return [await self.step(OUTPUTS[len(self.ids) - 1] if self.ids else None) for _ in range(count)]


def warmups_of(stack: Stack) -> list[dict[str, Any]]:
    """The bodies of the warm-up calls hq received."""
    return [body for body, headers in zip(stack.hq.received, stack.hq.headers_seen, strict=True)
            if headers.get("x-gateway-warmup") == "1"]


async def outcomes(stack: Stack, outcome: str) -> float:
    return await metric(stack.gateway, "gateway_cache_warmups_total", deployment="hq", outcome=outcome)


async def warmed_once(stack: Stack) -> None:
    async def done() -> bool:
        return await outcomes(stack, "done") == 1
    await until(done, what="the warm-up of hq done")


async def test_a_step_kept_home_by_the_price_warms_hq_and_the_next_step_moves_cheaply(
        make_stack: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=WARM)
    session = Session(stack, "warm")
    assert await session.steps(5) == ["hq", "hq", "fast", "fast", "fast"]
    assert warmups_of(stack) == []
    hq_input = await metric(stack.gateway, "gateway_tokens_total", deployment="hq", direction="input")
    stack.fast.faults = [Fault(hold=True)]  # step 5's answer waits: nothing is warmed before it is relayed
    step = asyncio.create_task(session.step(OUTPUTS[4]))
    await until(lambda: stack.fast.in_flight == 1, what="step 5 at fast")
    assert warmups_of(stack) == []
    stack.fast.release.set()
    assert await step == "fast"  # the error wanted hq: hq would prefill ~10k tokens, worth 100 ms: it stays
    await warmed_once(stack)
    [warmup] = warmups_of(stack)
    assert warmup["max_tokens"] == 1 and warmup["stream"] is False and warmup["model"] == "fake-hq"
    assert warmup["messages"] == session.messages and warmup["tools"] == TOOLS
    # charged: the prompt hq prefilled, as hq's input (and the tenant's)
    assert await metric(stack.gateway, "gateway_tokens_total", deployment="hq",
                        direction="input") == hq_input + prompt_tokens(warmup)

    # step 6 fails too: hq now lacks only what step 6 adds, as fast does; the move is cheap, it moves
    assert await session.step(OUTPUTS[5]) == "hq"
    explained = await explain(stack, session.ids[6])
    [held] = [line for line in explained if line.startswith("cache: ")]
    assert "hq holds " in held and " warmed (would prefill " in held, held
    assert any(line.startswith("switch: moves to hq: ") for line in explained), explained
    assert len(warmups_of(stack)) == 1
    assert await metric(stack.gateway, "gateway_cache_warmup_tokens_total", deployment="hq", kind="uncached") > 0

    base = str(stack.gateway.make_url("")).rstrip("/")
    shown = await recorded(base, "warm", 7)
    assert shown["steps"][5]["cache"]["warm_up"] == {"deployment": "hq", "outcome": "started"}
    assert shown["steps"][6]["cache"]["warmed"] == ["hq"] and shown["steps"][6]["cache"]["switched_from"] == "fast"
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["sessions", "show", "warm", "--url", base, "--admin-token", ADMIN_TOKEN]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("cache: ")]
    assert len(lines) == 7
    assert lines[5].startswith("cache: hq ") and lines[5].endswith("; warm-up hq started"), lines[5]
    assert " uncached (warmed)" in lines[6] and "moved from fast" in lines[6], lines[6]


async def test_without_warm_ups_the_next_step_stays(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=NO_WARM)
    session = Session(stack, "cold")
    assert await session.steps(7) == ["hq", "hq", "fast", "fast", "fast", "fast", "fast"]
    assert warmups_of(stack) == []


async def test_the_sessions_next_step_cancels_its_warm_up(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=WARM)
    session = Session(stack, "hurry")
    await session.steps(5)
    stack.hq.faults = [Fault(hold=True)]  # the warm-up reaches hq and waits there
    assert await session.step(OUTPUTS[4]) == "fast"
    await until(lambda: stack.hq.in_flight == 1, what="the warm-up at hq")
    assert await session.step("ok") == "fast"  # the agent's tool was quicker than hq's prefill

    async def cancelled() -> bool:
        return await outcomes(stack, "cancelled") == 1
    await until(cancelled, what="the warm-up cancelled")
    await until(lambda: stack.hq.in_flight == 0, what="hq's warm-up call dropped")
    assert await outcomes(stack, "done") == 0 and len(warmups_of(stack)) == 1
    explained = await explain(stack, session.ids[6])
    assert not any(" warmed " in line for line in explained), explained


async def test_a_deployment_with_requests_waiting_is_not_warmed(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=WARM)
    stack.hq.waiting = 2

    async def scraped() -> bool:
        return await metric(stack.gateway, "gateway_deployment_requests_waiting", deployment="hq") == 2
    await until(scraped, what="hq's queue seen")
    session = Session(stack, "busy")
    assert await session.steps(6) == ["hq", "hq", "fast", "fast", "fast", "fast"]

    async def skipped() -> bool:
        return await outcomes(stack, "busy") == 1
    await until(skipped, what="the warm-up skipped")
    assert warmups_of(stack) == []


async def test_a_warm_up_is_charged_to_the_tenants_budget(make_stack: Any) -> None:
    """The warm-up's tokens are the tenant's spend in the store (its budgets' windows), not only on /metrics."""
    stack: Stack = await make_stack(
        rules=RULES, extra=WARM + "tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 100}]}]\n")
    session = Session(stack, "charged")
    await session.steps(6)
    await warmed_once(stack)
    [warmup] = warmups_of(stack)
    base = str(stack.gateway.make_url("")).rstrip("/")

    async def hq_today() -> dict[str, Any]:
        status, body = await admin(base, "/admin/usage?tenant=anonymous")
        assert status == 200, body
        [row] = [r for r in body["data"] if r["deployment"] == "hq" and r["window"] == "day"]
        return dict(row)

    served = await metric(stack.gateway, "gateway_tokens_total", deployment="hq", direction="input")

    async def settled() -> dict[str, Any] | None:
        row = await hq_today()
        return row if row["reserved_usd"] == 0 and row["tokens_in"] == served else None

    # the two live hq steps and the warm-up, as hq reported them; nothing left held
    row = await until(settled, what="the warm-up settled in the store")
    assert prompt_tokens(warmup) < row["tokens_in"] and row["spend_usd"] > 0


async def test_a_warm_up_the_tenants_limits_have_no_room_for_is_skipped(make_stack: Any) -> None:
    """Six live steps use the tenant's six requests a minute: the warm-up after the sixth is not sent."""
    stack: Stack = await make_stack(
        rules=RULES, extra=WARM + "tenants: [{name: anonymous, requests_per_minute: 6}]\n")
    session = Session(stack, "no-room")
    assert await session.steps(6) == ["hq", "hq", "fast", "fast", "fast", "fast"]

    async def skipped() -> bool:
        return await outcomes(stack, "budget") == 1
    await until(skipped, what="the warm-up skipped for the budget")
    assert warmups_of(stack) == [] and await outcomes(stack, "done") == 0
