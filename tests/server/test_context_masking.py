"""The policy's context rules through a real gateway in front of the fake vLLM, with the real SDKs: the deployment
receives stubs in place of old tool outputs (every API), the originals come back from GET /v1/context/{ref} and
`agent-gateway context show` for their own tenant only, the trail and /metrics say what was masked, and a store
that cannot take the originals leaves the prompt unmasked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway.accounting import keys
from gateway.cli.command import main as cli
from gateway.context.masking import read_stub
from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric

LOGS = ["\n".join(f"step {i}: tests/test_mod{j}.py::test_case FAILED (assert {j} == {i})" for j in range(120))
        for i in range(6)]


def context_policy(objects: Path, **masking: Any) -> dict[str, Any]:
    return {"auth": {"enabled": True},
            "context": {"mask_tool_outputs": {"keep_last": 2, "over_tokens": 100, "batch_tokens": 500, **masking}},
            "store": {"objects": {"path": str(objects)}}}


def chat_messages(outputs: Sequence[str] = LOGS, task: str = "Why do the tests fail?",
                  thought: str | None = None) -> list[Any]:
    """An agent's conversation: the task, then a shell call and its output each; `thought` said before the last."""
    messages: list[Any] = [{"role": "user", "content": task}]
    for i, log in enumerate(outputs):
        said = thought if i == len(outputs) - 1 else None
        messages += [{"role": "assistant", "content": said, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "pytest"}'}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": log}]
    return messages


def responses_input() -> list[Any]:
    items: list[Any] = [{"role": "user", "content": "Why do the tests fail?"}]
    for i, log in enumerate(LOGS):
        items += [{"type": "function_call", "call_id": f"call_{i}", "name": "shell", "arguments": '{"cmd": "pytest"}'},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": log}]
    return items


def messages_history(outputs: Sequence[str] = LOGS, task: str = "Why do the tests fail?",
                     thought: str | None = None) -> list[Any]:
    """chat_messages in Anthropic's Messages form."""
    history: list[Any] = [{"role": "user", "content": task}]
    for i, log in enumerate(outputs):
        said = [{"type": "text", "text": thought}] if thought is not None and i == len(outputs) - 1 else []
        history += [{"role": "assistant", "content": [*said, {"type": "tool_use", "id": f"toolu_{i}", "name": "shell",
                                                               "input": {"cmd": "pytest"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": log}]}]
    return history


def outputs_received(api: str, body: dict[str, Any]) -> list[str]:
    if api == "chat":
        return [m["content"] for m in body["messages"] if m["role"] == "tool"]
    if api == "responses":
        return [item["output"] for item in body["input"] if item.get("type") == "function_call_output"]
    return [b["content"] for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
            if b["type"] == "tool_result"]


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0)


async def tenants(stack: Stack) -> tuple[str, str]:
    store = stack.gateway.app[STATE].accounting.store
    return (await keys.create(store, "acme"))[1], (await keys.create(store, "globex"))[1]


async def ask(stack: Stack, api: str, key: str) -> None:
    """One agent step in the API's own SDK."""
    if api == "messages":
        async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key=key, max_retries=0) as claude:
            await claude.messages.create(model="fast", max_tokens=16, messages=messages_history())
        return
    async with client(stack, key) as sdk:
        if api == "chat":
            await sdk.chat.completions.create(model="fast", max_tokens=16, messages=chat_messages())
        else:
            await sdk.responses.create(model="fast", max_output_tokens=16, input=responses_input())


async def original(stack: Stack, ref: str, key: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url(f"/v1/context/{ref}"),
                                                         headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_the_deployment_receives_stubs_and_the_originals_resolve_for_their_tenant_only(
    make_stack: Any, tmp_path: Path, api: str
) -> None:
    stack: Stack = await make_stack(context_policy(tmp_path / "objects"))
    acme, globex = await tenants(stack)
    await ask(stack, api, acme)
    received = outputs_received(api, stack.fast.received[-1])
    stubs = [read_stub(text) for text in received]
    assert [stub is not None for stub in stubs] == [True] * 4 + [False] * 2
    assert received[4:] == LOGS[4:]  # the newest two, byte for byte
    for (ref, _), log in zip([s for s in stubs if s is not None], LOGS, strict=False):
        assert await original(stack, ref, acme) == (200, log.encode())
        status, body = await original(stack, ref, globex)  # another tenant's: absent, not forbidden
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


async def test_the_trail_the_metrics_and_the_cli_say_what_was_masked(
    make_stack: Any, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    stack: Stack = await make_stack(context_policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(model="fast", max_tokens=16,
                                                                     messages=chat_messages())
    request_id = raw.headers["x-request-id"]
    async with aiohttp.ClientSession() as http, http.get(
            stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        trail = (await resp.json())["context"]["mask_tool_outputs"]
    assert trail["masked"] == 4 and trail["outputs"] == 6 and trail["frontier"] == 4 and trail["tokens_saved"] > 1000
    ref = trail["refs"][0]

    async def masked() -> float:
        return await metric(stack.gateway, "gateway_context_masked_outputs_total", api="chat")
    assert await until(masked) == 4
    assert await metric(stack.gateway, "gateway_context_masked_tokens_saved_total", api="chat") == \
        trail["tokens_saved"]
    assert await metric(stack.gateway, "gateway_context_offloads_total", outcome="stored") == 4

    url = str(stack.gateway.make_url("")).rstrip("/")
    assert await asyncio.to_thread(cli, ["context", "show", ref, "--url", url, "--api-key", acme]) == 0
    assert capsysbinary.readouterr().out == LOGS[0].encode()
    assert await asyncio.to_thread(cli, ["context", "show", ref, "--url", url, "--tenant", "acme",
                                         "--admin-token", ADMIN_TOKEN]) == 0
    assert capsysbinary.readouterr().out == LOGS[0].encode()
    assert await asyncio.to_thread(cli, ["context", "show", ref, "--url", url, "--tenant", "globex",
                                         "--admin-token", ADMIN_TOKEN]) == 2
    assert b"HTTP 404" in capsysbinary.readouterr().err


async def test_the_next_step_keeps_the_prefix_until_the_frontier_jumps(make_stack: Any, tmp_path: Path) -> None:
    """The prompt the deployment got at one step is the start of the next step's, byte for byte."""
    stack: Stack = await make_stack(context_policy(tmp_path / "objects", batch_tokens=6000))
    acme, _ = await tenants(stack)
    sent = []
    async with client(stack, acme) as sdk:
        for n in (5, 6):  # messages through the nth tool output
            messages = chat_messages()[:1 + 2 * n]
            await sdk.chat.completions.create(model="fast", max_tokens=16, messages=messages)
            sent.append(stack.fast.received[-1]["messages"])
    assert sent[1][:len(sent[0])] == sent[0]
    assert sum(read_stub(m["content"]) is not None for m in sent[1] if m["role"] == "tool") == 3


async def test_a_store_that_cannot_take_the_originals_leaves_the_prompt_unmasked(
    make_stack: Any, tmp_path: Path
) -> None:
    (tmp_path / "objects").write_text("a file where the folder should be")
    stack: Stack = await make_stack(context_policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        await sdk.chat.completions.create(model="fast", max_tokens=16, messages=chat_messages())
    assert outputs_received("chat", stack.fast.received[-1]) == LOGS  # no stub names what was not stored
    assert await metric(stack.gateway, "gateway_context_offloads_total", outcome="failed") == 4


async def test_masking_is_off_unless_the_policy_turns_it_on(make_stack: Any, tmp_path: Path) -> None:
    policy = context_policy(tmp_path / "objects")
    policy["models"] = {"fast": {"pin": "fast", "context": {}}, "auto": {"route": "rules"}}  # off on this route
    stack: Stack = await make_stack(policy)
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        await sdk.chat.completions.create(model="fast", max_tokens=16, messages=chat_messages())
    assert outputs_received("chat", stack.fast.received[-1]) == LOGS


async def test_the_session_shows_each_steps_masks_and_tokens_saved(
    make_stack: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.fixtures.agent_runs import recorded

    stack: Stack = await make_stack(context_policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="fast", max_tokens=16, messages=chat_messages(), extra_headers={"x-session-id": "masked-run"})
    async with aiohttp.ClientSession() as http, http.get(
            stack.gateway.make_url(f"/admin/requests/{raw.headers['x-request-id']}/explain"),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        saved = (await resp.json())["context"]["mask_tool_outputs"]["tokens_saved"]
    url = str(stack.gateway.make_url("")).rstrip("/")
    (step,) = (await recorded(url, "masked-run", 1))["steps"]
    assert step["context"] == {"masked_outputs": 4, "tokens_saved": saved}
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["sessions", "show", "masked-run", "--tenant", "acme", "--url", url,
                                         "--admin-token", ADMIN_TOKEN]) == 0
    assert f"context: 4 tool outputs masked, {saved:,} tokens saved" in capsys.readouterr().out
