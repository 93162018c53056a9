"""Anthropic's context_management done by the gateway in front of vLLM (the fake, which would ignore the field):
the deployment gets the edited body without the field, the anthropic SDK reads `applied_edits` (streamed and
not), a compaction's summary comes from the deployment, a bad edit is Anthropic's 400, Claude Code is answered."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import pytest

from fakes.faulty_vllm import Fault
from gateway.context.anthropic_edits import CLEARED_TOOL_RESULT
from gateway.context.summaries import INSTRUCTIONS, summary_message_text, written_summary
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric

BETAS: Any = ["context-management-2025-06-27"]
TOOLS: Any = [{"name": "Read", "description": "Read a file.",
               "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
LOG = "error: build failed at step {i}\n" * 40  # a tool result worth clearing


def four_tool_results() -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": "Why does the build fail?"}]
    for i in range(4):
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                               "input": {"file_path": f"/build/{i}.log"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                          "content": LOG.format(i=i)}]}]
    return messages


CLEAR: Any = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                         "keep": {"type": "tool_uses", "value": 1}}]}


def results_sent(body: dict[str, Any]) -> list[str]:
    return [b["content"] for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
            if b["type"] == "tool_result"]


@pytest.mark.parametrize("stream", [False, True])
async def test_old_tool_results_are_cleared_before_vllm_and_the_answer_says_so(
    make_stack: Any, stream: bool
) -> None:
    stack: Stack = await make_stack()
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        request: Any = {"model": "fast", "max_tokens": 64, "messages": four_tool_results(), "tools": TOOLS,
                        "context_management": CLEAR, "betas": BETAS}
        if stream:
            async with client.beta.messages.stream(**request) as events:
                message = await events.get_final_message()
        else:
            message = await client.beta.messages.create(**request)
    sent = stack.fast.received[-1]
    assert "context_management" not in sent
    assert results_sent(sent) == [CLEARED_TOOL_RESULT] * 3 + [LOG.format(i=3)]
    assert message.context_management is not None
    [applied] = message.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 3
    assert applied.cleared_input_tokens > 3 * 300  # each log is ~400 tokens; the placeholder ~12
    assert message.content[0].type == "text"  # the deployment's own answer, relayed

    async def counted() -> float:
        return await metric(stack.gateway, "gateway_context_edits_total", api="messages",
                            edit="clear_tool_uses_20250919")
    assert await until(counted) == 1
    cleared = await metric(stack.gateway, "gateway_context_cleared_tokens_total", edit="clear_tool_uses_20250919")
    assert cleared == applied.cleared_input_tokens


async def test_the_decision_trail_names_each_edit_and_the_tokens_before_and_after(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    async with aiohttp.ClientSession() as http:
        body = {"model": "fast", "max_tokens": 64, "messages": four_tool_results(), "context_management": CLEAR}
        async with http.post(stack.gateway.make_url("/v1/messages"), json=body) as resp:
            assert resp.status == 200
            request_id = resp.headers["x-request-id"]
        async with http.get(stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            trail = (await resp.json())["context"]
    [applied] = trail["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 3
    assert trail["tokens_before"] - trail["tokens_after"] == applied["cleared_input_tokens"] > 0


async def test_a_claude_code_turn_with_clear_thinking_is_answered(make_stack: Any) -> None:
    """Claude Code sends clear_thinking_20251015 on every turn, with its betas: never refused."""
    stack: Stack = await make_stack()
    thought = {"type": "thinking", "thinking": "Read it.", "signature": "s"}
    body = {"model": "fast", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": TOOLS, "thinking": {"type": "enabled", "budget_tokens": 4000},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "messages": [{"role": "user", "content": "Read the notes."},
                         {"role": "assistant", "content": [thought, {"type": "tool_use", "id": "toolu_1",
                                                                     "name": "Read",
                                                                     "input": {"file_path": "notes.txt"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "ship it"}]}]}
    headers = {"anthropic-beta": "claude-code-20250219,context-management-2025-06-27,interleaved-thinking-2025-05-14",
               "anthropic-version": "2023-06-01", "x-api-key": "k"}
    async with aiohttp.ClientSession() as http, http.post(stack.gateway.make_url("/v1/messages"), json=body,
                                                          headers=headers) as resp:
        assert resp.status == 200
        streamed = await resp.text()
    sent = stack.fast.received[-1]
    assert "context_management" not in sent
    assert sent["messages"] == body["messages"]  # keep "all": the thinking stays, the cache with it
    assert '"context_management":{"applied_edits":[]}' in streamed.split("event: message_delta")[1]


async def test_an_unknown_edit_is_anthropics_400_naming_the_field(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.beta.messages.create(
                model="fast", max_tokens=9, messages=[{"role": "user", "content": "hi"}], betas=BETAS,
                context_management={"edits": [{"type": "clear_everything_20990101"}]})  # type: ignore[list-item]
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "context_management.edits[0].type: 'clear_everything_20990101' is not a known edit type; use one "
                   "of clear_tool_uses_20250919, clear_thinking_20251015, compact_20260112"}}
    assert stack.fast.received == []


def long_conversation() -> list[Any]:
    """Past compaction's floor of 50,000 input tokens."""
    return [{"role": "user", "content": "Refactor the parser. " + "The parser reads tokens. " * 12_000},
            {"role": "assistant", "content": "Done: the parser is split in two."},
            {"role": "user", "content": "Now add tests."}]


COMPACT: Any = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_long_conversation_is_compacted_by_the_deployment_and_answered_from_its_summary(
    make_stack: Any, stream: bool
) -> None:
    stack: Stack = await make_stack()
    stack.fast.answer = lambda body: "SUMMARY: parser split; tests next."
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        request: Any = {"model": "fast", "max_tokens": 64, "messages": long_conversation(),
                        "context_management": COMPACT, "betas": ["compact-2026-01-12"]}
        if stream:
            async with client.beta.messages.stream(**request) as events:
                message = await events.get_final_message()
        else:
            message = await client.beta.messages.create(**request)
    assert stack.fast.paths == ["/v1/chat/completions", "/v1/messages"]
    summary_call, answered = stack.fast.received
    # the gateway's one summarizer: its anchored prompt, and the answer read back into its sections
    assert summary_call["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    assert "Now add tests." in summary_call["messages"][1]["content"]
    summary = written_summary("SUMMARY: parser split; tests next.")
    assert summary.startswith("## Goal\nSUMMARY: parser split; tests next.")
    assert answered["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": summary_message_text(summary)}]}]
    assert "context_management" not in answered
    first, *rest = message.content
    assert first.type == "compaction" and first.content == summary
    assert [block.type for block in rest] == ["text"]

    # The next turn sends the compaction back: the deployment reads the summary, then what followed it.
    follow: Any = [*long_conversation(), {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                   {"role": "user", "content": "Thanks."}]
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        await client.beta.messages.create(model="fast", max_tokens=9, messages=follow, context_management=COMPACT,
                                          betas=["compact-2026-01-12"])
    sent = stack.fast.received[-1]["messages"]
    assert sent[0] == answered["messages"][0]  # the same prefix: the deployment's cache holds
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]


async def test_pause_after_compaction_answers_the_compaction_block_alone(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    stack.fast.answer = lambda body: "SUMMARY"
    stack.fast.prefix_cache = True
    pause: Any = {"edits": [{**COMPACT["edits"][0], "pause_after_compaction": True}]}
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        message = await client.beta.messages.create(model="fast", max_tokens=64, messages=long_conversation(),
                                                    context_management=pause, betas=["compact-2026-01-12"])
        async with client.beta.messages.stream(model="fast", max_tokens=64, messages=long_conversation(),
                                               context_management=pause, betas=["compact-2026-01-12"]) as events:
            streamed = await events.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "compaction"
        assert [(b.type, getattr(b, "content", None)) for b in answer.content] == [
            ("compaction", written_summary("SUMMARY"))]
    assert stack.fast.paths == ["/v1/chat/completions"] * 2  # the deployment only wrote the summaries
    # the summary's usage, as Anthropic counts it: the second read the first's prompt from the prefix cache
    summaries = stack.fast.counted
    assert summaries[1].cached > 0
    for answer, summary in zip((message, streamed), summaries, strict=True):
        assert answer.usage.cache_read_input_tokens == summary.cached
        assert answer.usage.input_tokens + summary.cached == summary.tokens


async def test_the_summary_is_written_by_the_policys_compaction_deployment_and_counted_as_a_compaction(
    make_stack: Any,
) -> None:
    """One summarizer for every API: the call pinned to hq, its summary from `compaction.deployment` (fast by
    default), counted on gateway_compactions_total, not as a clearing edit."""
    stack: Stack = await make_stack()
    stack.fast.answer = lambda body: "## Goal\nsplit the parser"
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        await client.beta.messages.create(model="hq", max_tokens=9, messages=long_conversation(),
                                          context_management=COMPACT, betas=["compact-2026-01-12"])
    assert stack.fast.paths == ["/v1/chat/completions"] and stack.hq.paths == ["/v1/messages"]
    assert "split the parser" in stack.hq.received[0]["messages"][0]["content"][0]["text"]
    assert await metric(stack.gateway, "gateway_compactions_total", api="messages", trigger="anthropic_compact",
                        deployment="fast") == 1
    assert await metric(stack.gateway, "gateway_context_edits_total", edit="compact_20260112") == 0


async def test_the_requests_instructions_replace_the_summary_prompt_and_its_form(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    stack.fast.answer = lambda body: "  Three bullet points.  "
    own: Any = {"edits": [{**COMPACT["edits"][0], "instructions": "Summarize in three bullets."}]}
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        message = await client.beta.messages.create(model="fast", max_tokens=9, messages=long_conversation(),
                                                    context_management=own, betas=["compact-2026-01-12"])
    assert stack.fast.received[0]["messages"][0] == {"role": "system", "content": "Summarize in three bullets."}
    first: Any = message.content[0]
    assert first.type == "compaction" and first.content == "Three bullet points."  # not forced into sections


async def test_a_summary_no_deployment_writes_leaves_the_conversation_whole(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    stack.fast.faults += [Fault(status=500)]  # the summary, asked of fast first
    stack.hq.faults += [Fault(status=500)]  # then of hq, the call's failover
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        message = await client.beta.messages.create(model="fast", max_tokens=9, messages=long_conversation(),
                                                    context_management=COMPACT, betas=["compact-2026-01-12"])
    assert [block.type for block in message.content] == ["text"]
    assert stack.hq.paths == ["/v1/chat/completions"]  # asked, and failed too
    assert stack.fast.received[-1]["messages"] == long_conversation()  # answered whole
    assert await metric(stack.gateway, "gateway_compactions_total") == 0
