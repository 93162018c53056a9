"""The `x-session-outcome` header shortcut through the running gateway: an agent that cannot make a second call
says how its run ended on its last step; the recorder sets the outcome once that step is recorded."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.agent_runs import TOOLS, Agent, admin, recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack, metric


def _base(stack: Stack) -> str:
    return str(stack.gateway.make_url("")).rstrip("/")


async def test_the_last_steps_header_sets_the_outcome_once_the_step_is_recorded(stack: Stack) -> None:
    async with stack.client() as client:
        agent = await Agent(client, "hdr").run(2)
        await client.chat.completions.create(
            model="auto", messages=agent.messages, tools=TOOLS,  # type: ignore[arg-type]
            extra_headers={"x-session-id": "hdr", "x-session-outcome": "failure"})
    await recorded(_base(stack), "hdr", 3)

    async def reported() -> dict[str, object] | None:
        _, found = await admin(_base(stack), "/admin/sessions/hdr")
        return found if found["outcome"] is not None else None

    shown = await until(reported, what="the header's outcome recorded")
    outcome = shown["outcome"]
    assert isinstance(outcome, dict)
    assert outcome["success"] is False and outcome["source"] == "header"
    assert outcome["steps"] == 3 and outcome["cost_usd"] == pytest.approx(shown["cost_usd"])  # with its own step
    assert await metric(stack.gateway, "gateway_agent_session_outcomes_total", outcome="failure", mix="hq") == 1


async def test_a_header_that_is_neither_success_nor_failure_is_a_400(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="auto", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,  # type: ignore[arg-type]
                extra_headers={"x-session-id": "bad", "x-session-outcome": "done"})
    assert "x-session-outcome must be success or failure" in caught.value.message
    assert stack.hq.received == [] and stack.fast.received == []  # refused before any deployment saw it
