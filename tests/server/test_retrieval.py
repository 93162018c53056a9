"""The policy's `retrieve` through a real gateway in front of the fake vLLM, with the real SDKs and wordllama's
real embeddings: old tool outputs masked at one step come back at the next as one block at the prompt's end when
the step is about them (and only those); the trail, /metrics and the session's step say so; a stored Responses
conversation keeps no block; the pieces of a summarized span are retrieved one entry at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from gateway.context.masking import read_stub
from gateway.context.retrieval import BLOCK_OPEN, CHAT
from gateway.server.resources import STATE
from gateway.server.retrieval import Library
from gateway.store.objects import DiskObjects
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.agent_runs import recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric
from tests.server.test_context_masking import chat_messages, client, messages_history, outputs_received, tenants

FAILURE = "\n".join(["============ FAILURES ============", "___ test_zero ___",
                     "    def test_zero():", ">       assert compute_ratio(1, 0) == 0",
                     "src/ratio.py:2: in compute_ratio", "    return a / b",
                     "E   ZeroDivisionError: division by zero"] + [f"PASSED tests/test_other.py::test_{i}"
                                                                     for i in range(40)])
LISTING = "\n".join(f"drwxr-xr-x  2 agent agent 4096 Dec  5 docs/section_{i}" for i in range(60))
README = "\n".join(f"The project's manual, chapter {i}: installing, configuring and deploying it." for i in range(40))
OUTPUTS = [FAILURE, LISTING, README, "edited src/ratio.py"]
THOUGHT = "The suite still fails: compute_ratio raises ZeroDivisionError when b is 0. Guard it."


def policy(objects: Path) -> dict[str, Any]:
    return {"auth": {"enabled": True},
            "context": {"mask_tool_outputs": {"keep_last": 1, "over_tokens": 100, "batch_tokens": 0},
                        "retrieve": {"budget_tokens": 3_000, "min_score": 0.45}},
            "store": {"objects": {"path": str(objects)}}}


TASK = "Make the test suite pass."


def chat_conversation() -> list[Any]:
    return chat_messages(OUTPUTS, TASK, THOUGHT)


def messages_conversation() -> list[Any]:
    return messages_history(OUTPUTS, TASK, THOUGHT)


async def ask(stack: Stack, api: str, key: str) -> str:
    """One step; the gateway's request id."""
    headers = {"x-session-id": f"retrieval-{api}"}
    if api == "messages":
        async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key=key, max_retries=0,
                                            default_headers=headers) as claude:
            raw = await claude.messages.with_raw_response.create(model="fast", max_tokens=16,
                                                                 messages=messages_conversation())
    else:
        async with client(stack, key) as sdk:
            raw = await sdk.chat.completions.with_raw_response.create(
                model="fast", max_tokens=16, messages=chat_conversation(), extra_headers=headers)
    return raw.headers["x-request-id"]


def last_text(api: str, body: dict[str, Any]) -> str:
    last = body["messages"][-1]
    if api == "chat":
        return str(last["content"])
    return str(last["content"][-1].get("text", ""))


def stub_refs(api: str, body: dict[str, Any]) -> list[str]:
    found = [read_stub(text) for text in outputs_received(api, body)]
    return [stub[0] for stub in found if stub is not None]


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_masked_output_the_step_is_about_comes_back_at_the_prompts_end(
    make_stack: Any, tmp_path: Path, api: str
) -> None:
    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    await ask(stack, api, acme)
    first = stack.fast.received[-1]
    refs = stub_refs(api, first)
    assert len(refs) == 3 and BLOCK_OPEN not in last_text(api, first)  # masked, not yet indexed: no block
    library = stack.gateway.app[STATE].library
    await until(lambda: all(library.indexed("acme", ref) for ref in refs), what="the originals indexed")

    request_id = await ask(stack, api, acme)
    block = last_text(api, stack.fast.received[-1])
    assert block.startswith(BLOCK_OPEN)
    assert f"--- {refs[0]} ---\n{FAILURE}" in block  # the failure, whole
    assert LISTING not in block and README not in block  # the unrelated outputs stay masked
    async with aiohttp.ClientSession() as http, http.get(
            stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        trail = (await resp.json())["context"]["retrieve"]
    assert trail["candidates"] == 3 and [p["ref"] for p in trail["pieces"]] == [refs[0]]
    assert await metric(stack.gateway, "gateway_context_retrievals_total", outcome="put_back") == 1
    assert await metric(stack.gateway, "gateway_context_retrieved_pieces_total") == 1
    steps = (await recorded(str(stack.gateway.make_url("")).rstrip("/"), f"retrieval-{api}", 2))["steps"]
    assert "retrieved_pieces" not in steps[0].get("context", {})
    assert steps[1]["context"]["retrieved_pieces"] == 1 and steps[1]["context"]["retrieved_tokens"] > 0


async def test_the_entries_of_a_summarized_span_are_retrieved_one_by_one(tmp_path: Path) -> None:
    """The library over a span (a JSON array of entries): only the entry the step is about comes back."""
    store = DiskObjects(tmp_path / "objects", 1 << 30, 3600)
    await store.open()
    library = Library(store, make_metrics())
    entries = [{"role": "tool", "tool_call_id": f"c{i}", "content": text} for i, text in enumerate(OUTPUTS[:3])]
    document = json.dumps(entries).encode()
    from gateway.context.masking import reference

    ref = reference(document)
    await store.put("acme", ref, document)
    body = {"messages": [{"role": "user", "content": "task"}, {"role": "assistant", "content": THOUGHT}]}
    from gateway.context.retrieval import RetrieveRule

    rule = RetrieveRule(3_000, 3, 0.3)
    _, none_yet = await library.put_back(CHAT, rule, True, body, body, "acme", [(ref, True)])
    assert none_yet is None  # not indexed here: read from the store and indexed for the next step
    await until(lambda: library.indexed("acme", ref), what="the span indexed from the store")
    sent, found = await library.put_back(CHAT, rule, True, body, body, "acme", [(ref, True)])
    assert found is not None and [(c.candidate.ref, c.candidate.part) for c in found.chosen] == [(ref, 0)]
    assert sent["messages"][-1]["content"].count("--- ") == 1 and f"--- {ref} entry 0 ---" in \
        sent["messages"][-1]["content"]
    await library.close()
    await store.close()


async def test_a_stored_responses_conversation_keeps_no_block(make_stack: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    items: list[Any] = [{"role": "user", "content": "Make the test suite pass."}]
    for i, output in enumerate(OUTPUTS):
        if i == len(OUTPUTS) - 1:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": THOUGHT}]})
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "shell", "arguments": '{"cmd": "run"}'},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": output}]
    library = stack.gateway.app[STATE].library
    async with client(stack, acme) as sdk:
        await sdk.responses.create(model="fast", max_output_tokens=16, input=items)
        await until(lambda: library.size == 3, what="the originals indexed")
        second = await sdk.responses.create(model="fast", max_output_tokens=16, input=items)
        assert json.dumps(stack.fast.received[-1]["input"][-1]).count(BLOCK_OPEN.replace('"', '\\"')) == 1
        await sdk.responses.create(model="fast", max_output_tokens=16, previous_response_id=second.id,
                                   input=[{"role": "user", "content": "go on"}])
    chained = stack.fast.received[-1]["input"]
    escaped = BLOCK_OPEN.replace('"', '\\"')
    assert all(escaped not in json.dumps(item) for item in chained[:-1])  # never the step before's block
    assert "go on" in json.dumps(chained)
