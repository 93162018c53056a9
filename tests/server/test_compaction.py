"""Compaction of the Responses API served by the gateway, through the real `openai` SDK: /v1/responses/compact,
a compaction_trigger item (streamed and not), context_management's threshold; compaction items sent back
(whole or through previous_response_id) reach the deployment as the summary, never as an item; a forged,
altered or other-key item is a 400 in OpenAI's envelope; each compaction is on /metrics and in the trail."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from fakes.faulty_vllm import Fault
from gateway.context.seal import Seal
from gateway.context.summaries import SECTIONS, SUMMARY_LEAD
from gateway.policy.tenancy import Window
from gateway.server.resources import STATE
from tests.fixtures.stack import ADMIN_TOKEN, Stack

SUMMARY = ("## Goal\nFix the failing parser test.\n## Decisions\nKeep the tokenizer.\n"
           "## Files and artifacts\nsrc/parse.py\n## Errors and fixes\nIndexError at line 40: fixed.\n"
           "## Pending work\nRun the suite.\n## Next step\npytest -q")
KEY = "k" * 40
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the failing parser test in src/parse.py."},
    {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "pytest"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "IndexError: list index out of range (line 40)"},
    {"role": "assistant", "content": "I fixed the index in src/parse.py."},
]


def _summarizer(stack: Stack) -> None:
    """The fast fake answers chat completions (the summarizer's calls) with SUMMARY."""
    stack.fast.answer = lambda body: SUMMARY if (body.get("messages") or [{}])[0].get("role") == "system" else "tok tok"


def _texts(body: dict[str, Any]) -> str:
    return json.dumps(body.get("input"))


@pytest.fixture
async def compacting(make_stack: Any) -> Stack:
    stack: Stack = await make_stack(settings={"compaction_key": KEY})
    _summarizer(stack)
    return stack


async def _metrics(stack: Stack) -> str:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as reply:
        return await reply.text()


async def test_compact_endpoint_returns_the_user_messages_and_one_sealed_compaction_item(compacting: Stack) -> None:
    async with compacting.client() as client:
        compacted = await client.responses.compact(model="auto", input=CONVERSATION)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "compaction"]  # the user's message kept verbatim, then exactly one item
    item: Any = compacted.output[-1]
    assert item.id.startswith("cmp_") and not item.encrypted_content.startswith(SUMMARY_LEAD)
    payload = Seal(KEY.encode()).open(item.encrypted_content, "anonymous")
    assert [line.removeprefix("## ") for line in payload["summary"].splitlines() if line.startswith("## ")] == \
        list(SECTIONS)
    asked = compacting.fast.received[-1]
    assert compacting.fast.paths[-1] == "/v1/chat/completions" and "IndexError" in json.dumps(asked["messages"])
    assert compacted.usage.output_tokens == compacting.fast.chunks
    text = await _metrics(compacting)
    assert 'gateway_compactions_total{api="responses",deployment="fast",trigger="v1_compact"} 1.0' in text
    assert 'gateway_compaction_tokens_total{api="responses",stage="before",trigger="v1_compact"}' in text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_compaction_trigger_answers_exactly_one_compaction_item(compacting: Stack, stream: bool) -> None:
    trigger: list[Any] = [*CONVERSATION, {"type": "compaction_trigger"}]
    async with compacting.client() as client:
        if stream:
            events = [event async for event in await client.responses.create(
                model="auto", input=trigger, stream=True, store=False)]
            kinds = [event.type for event in events]
            assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.output_item.done", "response.completed"]
            assert [event.sequence_number for event in events] == [0, 1, 2, 3, 4]
            output = events[-1].response.output  # type: ignore[union-attr]
            done: Any = events[3]
            assert done.item.type == "compaction" and done.output_index == 0
        else:
            output = (await client.responses.create(model="auto", input=trigger)).output
    assert [item.type for item in output] == ["compaction"]
    assert compacting.hq.received == [] and compacting.fast.paths == ["/v1/chat/completions"]
    assert "compaction_trigger" not in json.dumps(compacting.fast.received)


async def test_a_compaction_item_sent_back_reaches_the_deployment_as_its_summary(compacting: Stack) -> None:
    async with compacting.client() as client:
        compacted = await client.responses.compact(model="auto", input=CONVERSATION)  # type: ignore[arg-type]
        history = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
        await client.responses.create(model="fast", input=[*history, {"role": "user", "content": "Go on."}])
    forwarded = compacting.fast.received[-1]
    assert compacting.fast.paths[-1] == "/v1/responses"
    assert all(item.get("type") != "compaction" for item in forwarded["input"])
    assert SUMMARY_LEAD.strip() in _texts(forwarded) and "Run the suite." in _texts(forwarded)
    assert "IndexError: list index out of range" not in _texts(forwarded)  # the summary stands in for the tool


async def test_a_trigger_chained_by_previous_response_id_reads_the_summary(compacting: Stack) -> None:
    async with compacting.client() as client:
        first = await client.responses.create(model="fast", input=CONVERSATION)  # type: ignore[arg-type]
        compacted = await client.responses.create(model="auto", previous_response_id=first.id,
                                                  input=[{"type": "compaction_trigger"}])  # type: ignore[list-item]
        assert [item.type for item in compacted.output] == ["compaction"]
        await client.responses.create(model="fast", previous_response_id=compacted.id, input="Go on.")
    forwarded = compacting.fast.received[-1]
    assert all(item.get("type") != "compaction" for item in forwarded["input"])
    assert "Run the suite." in _texts(forwarded) and "IndexError: list index" not in _texts(forwarded)
    assert "Fix the failing parser test in src/parse.py." in _texts(forwarded)  # the user's own message stays


def _altered(token: str) -> str:
    middle = len(token) // 2
    return token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1:]


@pytest.mark.parametrize("spoil", ["forged", "altered", "other key", "other tenant"])
async def test_a_compaction_item_that_does_not_open_is_a_400(compacting: Stack, spoil: str) -> None:
    async with compacting.client() as client:
        compacted = await client.responses.compact(model="auto", input=CONVERSATION)  # type: ignore[arg-type]
        token: str = compacted.output[-1].encrypted_content  # type: ignore[union-attr]
        tokens = {"forged": "gAAAAABpM0Yj-plain-text-posing-as-openai", "altered": _altered(token),
                  "other key": Seal(b"x" * 40).close({"summary": "lies"}, "anonymous"),
                  "other tenant": Seal(KEY.encode()).close({"summary": "theirs"}, "tenant-b")}
        before = len(compacting.fast.received)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="fast", input=[
                {"type": "compaction", "encrypted_content": tokens[spoil]}, {"role": "user", "content": "Go on."}])
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_compaction_item"
    assert error["param"] == "input[0].encrypted_content" and "does not open" in error["message"]
    assert len(compacting.fast.received) == before  # nothing reached a deployment


@pytest.mark.parametrize("stream", [False, True])
async def test_context_management_over_its_threshold_compacts_before_answering(
        compacting: Stack, stream: bool) -> None:
    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with compacting.client() as client:
        if stream:
            events = [e async for e in await client.responses.create(
                model="fast", input=CONVERSATION, stream=True, extra_body=settings)]  # type: ignore[arg-type]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            added: Any = events[2]
            assert added.type == "response.output_item.added" and added.item.type == "compaction"
            assert all(getattr(e, "output_index", 0) >= 1 for e in events[4:-1])
            output = events[-1].response.output  # type: ignore[union-attr]
        else:
            output = (await client.responses.create(model="fast", input=CONVERSATION,  # type: ignore[arg-type]
                                                    extra_body=settings)).output
    assert [item.type for item in output][:2] == ["compaction", "message"]
    forwarded = compacting.fast.received[-1]
    assert "Run the suite." in _texts(forwarded) and "IndexError: list index" not in _texts(forwarded)
    text = await _metrics(compacting)
    assert 'trigger="context_management"} 1.0' in text


async def test_under_its_threshold_context_management_changes_nothing(compacting: Stack) -> None:
    async with compacting.client() as client:
        answer = await client.responses.create(model="fast", input=CONVERSATION,  # type: ignore[arg-type]
                                               extra_body={"context_management": [
                                                   {"type": "compaction", "compact_threshold": 100_000}]})
    assert [item.type for item in answer.output] == ["message"]
    assert compacting.fast.paths == ["/v1/responses"]


async def test_the_trail_shows_the_compaction_and_its_deployment(compacting: Stack) -> None:
    async with compacting.client() as client:
        raw = await client.responses.with_raw_response.create(
            model="auto", input=[*CONVERSATION, {"type": "compaction_trigger"}])  # type: ignore[list-item]
    assert raw.headers["x-gateway-deployment"] == "fast" and raw.headers["x-gateway-rule"] == "compaction"
    url = compacting.gateway.make_url(f"/admin/requests/{raw.headers['x-request-id']}/explain")
    async with aiohttp.ClientSession() as http, http.get(
            url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
        served = (await reply.json())["served"]
    assert served["rule"] == "compaction" and "v2_trigger" in served["reasons"][0]
    assert len(served["compactions"]) == 1 and "fast summarized" in served["compactions"][0]


async def test_a_production_gateway_without_its_key_does_not_start(make_stack: Any) -> None:
    with pytest.raises(ValueError, match="AGENT_GATEWAY_COMPACTION_KEY must be set in production"):
        await make_stack(settings={"environment": "production"})


async def test_the_summary_before_an_answer_that_fails_is_still_charged_to_the_budget(make_stack: Any) -> None:
    """The summary is a side call of the request (Exchange.side_call): settled with the tenant even when no
    deployment then answers."""
    stack: Stack = await make_stack("tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]",
                                    settings={"compaction_key": KEY})
    _summarizer(stack)
    stack.fast.faults += [Fault(), Fault(status=500)]  # the summary, then the answer
    stack.hq.faults += [Fault(status=500)]  # the answer's failover
    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError):
            await client.responses.create(model="fast", input=CONVERSATION, extra_body=settings)  # type: ignore[arg-type]
    assert stack.fast.paths[0] == "/v1/chat/completions"
    day = (await stack.gateway.app[STATE].accounting.store.snapshot("anonymous")).windows[Window.DAY]
    summary_usd = (11 * 0.5 + stack.fast.chunks * 1.5) / 1e6  # the fake's usage at fast's price
    assert (day.spend_usd, day.reserved_usd) == (pytest.approx(summary_usd), 0)


async def test_a_compaction_is_charged_to_the_session_and_counted_apart(compacting: Stack) -> None:
    """The summary's cost is part of the step's (and so the session's) cost, said apart on the step and on
    /metrics by who asked for it."""
    from tests.fixtures.agent_runs import recorded
    from tests.fixtures.stack import metric

    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with compacting.client() as client:
        await client.responses.create(model="fast", input=CONVERSATION, extra_body=settings,  # type: ignore[arg-type]
                                      extra_headers={"x-session-id": "compacted-run"})
    base = str(compacting.gateway.make_url("")).rstrip("/")
    (step,) = (await recorded(base, "compacted-run", 1))["steps"]
    per_call_usd = (11 * 0.5 + compacting.fast.chunks * 1.5) / 1e6  # the fake's usage at fast's price
    assert step["compaction"] == {"by": "context_management", "cost_usd": pytest.approx(per_call_usd)}
    assert step["cost_usd"] == pytest.approx(2 * per_call_usd)  # the summary, then the answer
    assert await metric(compacting.gateway, "gateway_compaction_cost_usd_total", trigger="context_management",
                        deployment="fast") == pytest.approx(per_call_usd)


async def test_a_summary_that_fails_leaves_the_input_whole(compacting: Stack) -> None:
    compacting.fast.faults += [Fault(status=500)]
    compacting.hq.faults += [Fault(status=500)]
    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with compacting.client() as client:
        answer = await client.responses.create(model="fast", input=CONVERSATION,  # type: ignore[arg-type]
                                               extra_body=settings)
    assert [item.type for item in answer.output] == ["message"]
    assert "IndexError: list index out of range" in _texts(compacting.fast.received[-1])
    assert 'gateway_compactions_total{' not in await _metrics(compacting)


async def _with_windows(fake_pair: Any, make_stack: Any, hq: int, fast: int, extra: Any = "") -> Stack:
    """A stack whose fake hq and fast serve these windows, once the gateway has learned them."""
    from tests.fixtures.conditions import until

    fake_pair[0].max_model_len, fake_pair[2].max_model_len = hq, fast
    stack: Stack = await make_stack(extra)

    async def learned() -> bool:
        async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/v1/models")) as resp:
            models = {m["id"]: m for m in (await resp.json())["data"]}
        return bool(models["hq"].get("context_window") == hq and models["fast"].get("context_window") == fast)
    await until(learned, what="the gateway learned both windows")
    return stack


async def test_an_agents_own_compaction_request_is_counted_and_goes_to_the_larger_window(
        fake_pair: Any, make_stack: Any) -> None:
    """Codex's compaction turn, through chat completions: hq's window is the larger; the rules alone pick fast."""
    from tests.decision.test_windows import CODEX_COMPACT
    from tests.fixtures.stack import metric

    stack = await _with_windows(fake_pair, make_stack, 32768, 16384)
    history = [{"role": "user", "content": "Fix the failing test."}, {"role": "assistant", "content": "Done."}]
    async with stack.client() as client:
        plain = await client.chat.completions.with_raw_response.create(
            model="auto", messages=[*history, {"role": "user", "content": "And now?"}])  # type: ignore[list-item]
        asked = await client.chat.completions.with_raw_response.create(
            model="auto", messages=[*history, {"role": "user", "content": CODEX_COMPACT}])  # type: ignore[list-item]
    assert plain.headers["x-gateway-deployment"] == "fast"
    assert asked.headers["x-gateway-deployment"] == "hq"
    assert await metric(stack.gateway, "gateway_agent_compaction_requests_total", agent="codex", deployment="hq") == 1
    hq_usd = (11 * 3 + stack.hq.chunks * 15) / 1e6  # the whole answer is the summary: at hq's price
    assert await metric(stack.gateway, "gateway_compaction_cost_usd_total", trigger="codex",
                        deployment="hq") == pytest.approx(hq_usd)


async def test_an_agents_summary_request_no_window_holds_is_masked_until_it_fits(
        fake_pair: Any, make_stack: Any) -> None:
    """Six 2,500-token tool outputs and Codex's compaction turn fit neither window (hq 8,192, fast 4,096): the
    oldest outputs are masked (all but the newest three would still not fit; all but the newest does), their
    originals offloaded, and hq answers instead of a 400 context_length_exceeded."""
    from tests.decision.test_windows import CODEX_COMPACT
    from tests.fixtures.stack import metric

    stack = await _with_windows(fake_pair, make_stack, 8192, 4096)
    outputs = [f"== file {i} ==\n" + f"line {i}: value = compute({i})\n" * 180 for i in range(6)]  # ~5,000 bytes each
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i, output in enumerate(outputs):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"c{i}", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": output}]
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:  # not a compaction request: no window holds it
            await client.chat.completions.create(
                model="auto", messages=[*messages, {"role": "user", "content": "Go on."}])
        assert refused.value.code == "context_length_exceeded"
        raw = await client.chat.completions.with_raw_response.create(
            model="auto", max_tokens=64, messages=[*messages, {"role": "user", "content": CODEX_COMPACT}])
    assert raw.headers["x-gateway-deployment"] == "hq"
    sent = [m["content"] for m in stack.hq.received[-1]["messages"] if m["role"] == "tool"]
    assert [s.startswith("[tool output masked by the gateway") for s in sent] == [True] * 5 + [False]
    assert sent[5] == outputs[5]
    ref = sent[0].split("the whole output is ", 1)[1][:68]
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url(f"/v1/context/{ref}")) as resp:
        assert resp.status == 200 and await resp.text() == outputs[0]
    assert await metric(stack.gateway, "gateway_agent_compaction_requests_total", agent="codex", deployment="hq") == 1
    hq_usd = (11 * 3 + stack.hq.chunks * 15) / 1e6  # the whole answer is the summary: at hq's price
    assert await metric(stack.gateway, "gateway_compaction_cost_usd_total", trigger="codex",
                        deployment="hq") == pytest.approx(hq_usd)


async def test_with_context_rules_a_step_over_every_window_is_masked_down_to_its_runaway_answer(
        fake_pair: Any, make_stack: Any, tmp_path: Any) -> None:
    """Where the policy manages context, any step that fits no window is fitted, not only an agent's summary
    request: its tool outputs first, then (here: all that is left) an assistant turn over 2,000 tokens, an
    agent's own runaway answer, which gives way to a stub; the whole turn stays readable in the object store."""
    from gateway.context.masking import read_stub

    rules = {"context": {"summarize_old_turns": {"over_tokens": 60_000, "keep_tokens": 1_000}},
             "store": {"objects": {"path": str(tmp_path / "objects")}}}
    stack = await _with_windows(fake_pair, make_stack, 8192, 4096, rules)
    runaway = "I will now list every step again. " * 1_500  # ~12,000 tokens of an agent's own answer
    messages = [{"role": "user", "content": "Fix the failing test."}, {"role": "assistant", "content": runaway},
                {"role": "user", "content": "That answer was malformed: one command, please."}]
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", max_tokens=16, messages=messages)
    assert raw.headers["x-gateway-deployment"] in ("hq", "fast")
    sent = raw.headers["x-gateway-deployment"]
    body = (stack.hq if sent == "hq" else stack.fast).received[-1]
    turn = body["messages"][1]["content"]
    assert turn.startswith("[assistant turn masked by the gateway") and body["messages"][2] == messages[2]
    found = read_stub(turn)
    assert found is not None
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url(f"/v1/context/{found[0]}")) as resp:
        assert resp.status == 200 and await resp.text() == runaway


async def test_without_context_rules_a_step_over_every_window_is_still_refused(fake_pair: Any, make_stack: Any) -> None:
    stack = await _with_windows(fake_pair, make_stack, 8192, 4096)
    messages = [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "again " * 12_000},
                {"role": "user", "content": "Go on."}]
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="auto", max_tokens=16, messages=messages)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
