"""The policy's `summarize_old_turns` through a real gateway in front of the fake vLLM, with the real SDKs (every
API): a step over the rule is sent whole and its old turns are summarized after it, on fast, as the
conversation's next turn; the next step reaches the deployment with the summary in the span's place and the same
bytes before it at the step after (the prefix stays cached); the summarized entries resolve from the object store
for their tenant; the summary is charged; the trail, /metrics and the session's step say what was done."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from gateway.cli.command import main as cli
from gateway.context.eviction import CHAT, MESSAGES, RESPONSES, EvictRule, TurnShape, boundary, read_turns
from gateway.context.summaries import INSTRUCTIONS
from gateway.server.resources import STATE
from tests.fixtures.agent_runs import recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric
from tests.server.test_context_masking import (
    chat_messages,
    client,
    messages_history,
    original,
    responses_input,
    tenants,
)

SUMMARY = "## Goal\nFind why the tests fail.\n## Next step\nRead tests/test_mod3.py"
RULE = {"over_tokens": 6_500, "keep_tokens": 3_000, "summary_tokens": 100}
SHAPES: dict[str, TurnShape] = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


def policy(objects: Path) -> dict[str, Any]:
    return {"auth": {"enabled": True}, "context": {"summarize_old_turns": RULE},
            "store": {"objects": {"path": str(objects)}}}


def is_summary_request(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    return isinstance(last.get("content"), str) and last["content"].startswith(INSTRUCTIONS[:40])


def conversation(api: str) -> list[Any]:
    return {"chat": chat_messages, "responses": responses_input, "messages": messages_history}[api]()


def later(api: str, entries: list[Any], n: int) -> list[Any]:
    """The conversation n small turns on: an assistant's words and the user's answer."""
    for i in range(n):
        if api == "responses":
            entries = [*entries, {"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": f"looking {i}"}]},
                       {"role": "user", "content": f"go on {i}"}]
        else:
            entries = [*entries, {"role": "assistant", "content": f"looking {i}"},
                       {"role": "user", "content": f"go on {i}"}]
    return entries


async def step(stack: Stack, api: str, key: str, entries: list[Any], session: str) -> None:
    headers = {"x-session-id": session}
    if api == "messages":
        async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key=key, max_retries=0,
                                            default_headers=headers) as claude:
            await claude.messages.create(model="fast", max_tokens=16, messages=entries)
        return
    async with client(stack, key) as sdk:
        if api == "chat":
            await sdk.chat.completions.create(model="fast", max_tokens=16, messages=entries, extra_headers=headers)
        else:
            await sdk.responses.create(model="fast", max_output_tokens=16, input=entries, extra_headers=headers)


def entries_of(api: str, body: dict[str, Any]) -> list[Any]:
    return list(body["input" if api == "responses" else "messages"])


def served(stack: Stack) -> list[dict[str, Any]]:
    return [body for body in stack.fast.received if not is_summary_request(body)]


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_old_turns_are_summarized_after_a_step_and_sent_as_one_summary_from_the_next(
    make_stack: Any, tmp_path: Path, api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    stack.fast.answer = lambda body: SUMMARY if is_summary_request(body) else "tok tok"
    acme, globex = await tenants(stack)
    first = conversation(api)

    await step(stack, api, acme, first, "s-1")
    assert len(entries_of(api, served(stack)[-1])) == len(first)  # no summary ready yet: sent whole
    await until(lambda: any(is_summary_request(b) for b in stack.fast.received), what="the summary's request")
    asked = next(b for b in stack.fast.received if is_summary_request(b))
    # the summarizer continues the conversation as the deployment read it, through the span now due
    turns = read_turns(SHAPES[api], {SHAPES[api].key: first})
    assert turns is not None
    cut = boundary(turns, EvictRule(**RULE))
    assert turns.head < cut < len(first)
    assert asked["model"] == stack.fast.served_model and asked["max_tokens"] == RULE["summary_tokens"]
    if api == "chat":  # the very messages the deployment read (its prefix cache holds them), then the ask
        assert asked["messages"][:-1] == first[:cut]
    else:  # the same conversation in the chat view
        assert len(asked["messages"]) >= cut
    evictions = stack.gateway.app[STATE].evictions
    await until(lambda: evictions.ready_for("acme"), what="the summary kept")

    second = later(api, first, 1)
    await step(stack, api, acme, second, "s-1")
    got = entries_of(api, served(stack)[-1])
    assert got[:turns.head] == first[:turns.head]  # the task, as sent
    text = json.dumps(got[turns.head])
    assert "Context summary written by the gateway" in text and "Find why the tests fail" in text
    assert got[turns.head + 1:] == second[cut:]  # the newest turns whole, after the summary
    ref = text.split("kept whole as ")[1].split(" ")[0]
    status, document = await original(stack, ref, acme)
    assert status == 200 and json.loads(document) == first[turns.head:cut]
    assert (await original(stack, ref, globex))[0] == 404

    await step(stack, api, acme, later(api, first, 2), "s-1")
    third = entries_of(api, served(stack)[-1])
    assert third[:len(got)] == got  # the same summary, the same bytes: the deployment's prefix cache holds them

    server = stack.gateway
    assert await metric(server, "gateway_context_summaries_total", outcome="written") == 1
    assert await metric(server, "gateway_context_summarized_entries_total", api=api) == 2 * (cut - turns.head)
    steps = (await recorded(str(server.make_url("")).rstrip("/"), "s-1", 3))["steps"]
    assert "summarized_entries" not in steps[0].get("context", {})
    assert [s["context"]["summarized_entries"] for s in steps[1:]] == [cut - turns.head] * 2
    saved = steps[1]["context"]["summary_tokens_saved"]
    assert saved > 0
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["sessions", "show", "s-1", "--tenant", "acme", "--admin-token", ADMIN_TOKEN,
                                         "--url", str(server.make_url("")).rstrip("/")]) == 0
    assert f"context: {cut - turns.head} old entries summarized, {saved:,} tokens saved" in capsys.readouterr().out
    # the summary's tokens are charged to the tenant beside its steps'
    charged = await metric(server, "gateway_tenant_tokens_total", tenant="acme", direction="output")
    assert charged > sum(s["tokens_out"] for s in steps)


async def test_a_summary_that_fails_leaves_the_steps_whole_and_is_not_asked_again_at_once(
    make_stack: Any, tmp_path: Path
) -> None:
    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    stack.fast.answer = lambda body: "" if is_summary_request(body) else "tok tok"  # writes no summary
    acme, _ = await tenants(stack)
    first = conversation("chat")
    await step(stack, "chat", acme, first, "s-2")
    await until(lambda: metric(stack.gateway, "gateway_context_summaries_total", outcome="failed"),
                what="the failed summary counted")
    await step(stack, "chat", acme, later("chat", first, 1), "s-2")
    assert entries_of("chat", served(stack)[-1]) == later("chat", first, 1)  # whole, as the client sent it
    assert sum(is_summary_request(b) for b in stack.fast.received) == 1  # the span's failure holds a minute
