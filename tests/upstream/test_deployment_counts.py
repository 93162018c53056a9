"""A prompt near a window is counted by the deployment's own /tokenize, only its new part each step; a count that
fails or stalls falls back to a bound, with a warning and a metric, within its timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from fakes.faulty_vllm import FakeVLLM, Fault
from gateway.decision import windows
from gateway.decision.call import Call, read_call
from gateway.features import extract
from gateway.policy.model import Policy
from gateway.telemetry.metrics import Metrics, make_metrics
from gateway.upstream import forward as upstream
from gateway.upstream.deployment_counts import DeploymentCounts, Memo, chain, parts
from tests.fixtures.stack import policy_data

SYSTEM = "You are a coding agent. " * 400  # ~10 KB: Codex-like instructions
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Runs a command. " * 20,
                                           "parameters": {"type": "object", "properties": {}}}}]
WINDOWS = {"hq": 8192, "fast": 8192}


def _counter(metrics: Metrics) -> Callable[[str, str], None]:
    return lambda name, outcome: metrics.deployment_counts.labels(name, outcome).inc()  # as create_app wires it


def _call(policy: Policy, messages: list[dict[str, Any]], **body: Any) -> Call:
    full = {"model": "auto", "messages": messages, "tools": TOOLS, **body}
    return read_call(policy, "chat", full, full, 0, extract(full, "chat"), {}, None)


def _step(n: int) -> list[dict[str, Any]]:
    """An agent's conversation after n tool results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix it"}]
    for i in range(n):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "shell", "arguments": f'{{"n": {i}}}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"output of step {i}\n" * 50})
    return messages


@pytest.fixture
async def fakes(aiohttp_server: Callable[..., Any]) -> tuple[FakeVLLM, FakeVLLM, Policy]:
    hq, fast = FakeVLLM("fake-hq"), FakeVLLM("fake-fast")
    urls = [str((await aiohttp_server(f.app())).make_url("")).rstrip("/") for f in (hq, fast)]
    data = policy_data(*urls)
    data["deployments"]["hq"]["endpoints"] = ["chat"]  # only hq: one fake to watch
    data["deployments"]["fast"]["endpoints"] = ["completions"]
    return hq, fast, Policy.model_validate(data)


async def test_each_step_sends_tokenize_only_its_new_messages(fakes: tuple[FakeVLLM, FakeVLLM, Policy]) -> None:
    hq, _, policy = fakes
    pool = upstream.make_client(4)
    metrics = make_metrics()
    try:
        counter = DeploymentCounts(pool, _counter(metrics))
        first = await counter.count(_call(policy, _step(1)), WINDOWS)
        assert len(hq.tokenized) == 1 and SYSTEM in hq.tokenized[0]
        second = await counter.count(_call(policy, _step(2)), WINDOWS)
        assert len(hq.tokenized) == 2
        new_part = hq.tokenized[1]
        assert SYSTEM not in new_part and "output of step 1" in new_part and "output of step 0" not in new_part
        # the two counts add up to what one count of the whole prompt gives, plus the template's wrapping
        whole = "\n".join(p for p in parts(_call(policy, _step(2)).view, "chat") if isinstance(p, str))
        call = _call(policy, _step(2))
        assert second["hq"] == windows.Count(hq.count(hq.tokenized[0]) + hq.count(new_part)
                                             + windows.template_tokens(call.features), True)
        assert abs(second["hq"].tokens - windows.template_tokens(call.features) - hq.count(whole)) <= 2
        assert first["hq"].tokens < second["hq"].tokens
        again = await counter.count(_call(policy, _step(2)), WINDOWS)  # a retry of the same step: no call at all
        assert again == second and len(hq.tokenized) == 2
        assert metrics.totals("gateway_deployment_prompt_counts") == {
            (("deployment", "hq"), ("outcome", "counted")): 2.0, (("deployment", "hq"), ("outcome", "memo")): 1.0}
    finally:
        await pool.close()


async def test_a_prompt_far_from_every_window_asks_no_deployment(fakes: tuple[FakeVLLM, FakeVLLM, Policy]) -> None:
    hq, _, policy = fakes
    pool = upstream.make_client(4)
    try:
        found = await DeploymentCounts(pool, _counter(make_metrics())).count(_call(policy, _step(1)), {"hq": 131072})
        assert found == {} and hq.tokenized == []
    finally:
        await pool.close()


@pytest.mark.parametrize("fault", [Fault(status=500), Fault(stall_s=5.0)], ids=["error", "stall"])
async def test_a_failing_count_falls_back_to_a_bound_with_a_warning_and_a_metric(
    fakes: tuple[FakeVLLM, FakeVLLM, Policy], fault: Fault, caplog: pytest.LogCaptureFixture
) -> None:
    hq, _, policy = fakes
    hq.tokenize_fault = fault
    pool, metrics = upstream.make_client(4), make_metrics()
    try:
        call = _call(policy, _step(3))
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            found = await DeploymentCounts(pool, _counter(metrics), timeout_s=0.5).count(call, WINDOWS)
        assert time.monotonic() - started < 3.0  # bounded by the timeout, not the stall
        assert found["hq"].counted is False
        # the bound: the exact cl100k count times the ratio, at least what the deployment would have counted
        assert found["hq"].tokens >= call.features.prompt_tokens * windows.TOKENS_PER_CL100K_MAX
        assert "could not count a prompt" in caplog.text
        assert metrics.totals("gateway_deployment_prompt_counts") == {
            (("deployment", "hq"), ("outcome", "failed")): 1.0}
    finally:
        await pool.close()


def test_equal_links_are_equal_prefixes_and_the_memo_is_bounded() -> None:
    a, b = chain(["tools", "system", "user"]), chain(["tools", "system", "other"])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chain(["ab", "c"])[-1] != chain(["a", "bc"])[-1]  # parts are hashed apart, not concatenated
    memo = Memo(size=3)
    for i, link in enumerate(chain([str(i) for i in range(5)])):
        memo.keep("hq", link, i)
    assert len(memo) == 3
    assert memo.longest("hq", chain([str(i) for i in range(5)])) == (5, 4)
    assert memo.longest("hq", chain(["0", "1"])) == (0, 0)  # the oldest were dropped
    assert memo.longest("fast", chain([str(i) for i in range(5)])) == (0, 0)  # per deployment


async def test_a_prompt_whose_history_was_edited_is_counted_anew_not_from_the_memo(
    fakes: tuple[FakeVLLM, FakeVLLM, Policy],
) -> None:
    """The memo is keyed by the call's prompt chain, whose links hash everything before them: a prompt whose
    history was rewritten (a tool result masked) matches no counted prompt and is counted whole."""
    hq, _, policy = fakes
    pool = upstream.make_client(4)
    try:
        counter = DeploymentCounts(pool, _counter(make_metrics()))
        before = await counter.count(_call(policy, _step(3)), WINDOWS)
        edited = _step(3)
        edited[3] = {**edited[3], "content": "[output cleared]"}  # the first tool result, masked
        found = await counter.count(_call(policy, edited), WINDOWS)
        assert len(hq.tokenized) == 2
        again = hq.tokenized[1]
        assert SYSTEM in again and "[output cleared]" in again and "output of step 0" not in again
        assert found["hq"].tokens < before["hq"].tokens
    finally:
        await pool.close()


async def test_the_prompt_is_hashed_once_a_call_for_the_window_count_and_the_session_caches(
    fakes: tuple[FakeVLLM, FakeVLLM, Policy], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gateway.decision.call as call_module

    hashed: list[int] = []
    chain_of = call_module.chain_of
    monkeypatch.setattr(call_module, "chain_of", lambda *args: hashed.append(1) or chain_of(*args))
    _, _, policy = fakes
    pool = upstream.make_client(4)
    try:
        call = _call(policy, _step(2))
        await DeploymentCounts(pool, _counter(make_metrics())).count(call, WINDOWS)
        assert call.prompt[-1].digest == chain_of(call.view, 1)[-1].digest  # what the sighting reads
        assert len(hashed) == 1
    finally:
        await pool.close()
