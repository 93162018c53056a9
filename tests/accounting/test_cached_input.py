"""Cached input through the running gateway: a deployment's prefix-cache hits, as its usage reports them, are
charged at the cached input price in the settle, the session's steps and /metrics, and reach the clients."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest
import yaml

from fakes.faulty_vllm import FakeVLLM, Prompt
from gateway.cli import simulate
from gateway.policy import model as policy_module
from gateway.policy.model import Price
from gateway.policy.tenancy import Window
from gateway.server.resources import STATE
from tests.fixtures.agent_runs import Agent, recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack, metric, policy_data

HQ = Price(input_per_mtok_usd=3, output_per_mtok_usd=15, cached_input_per_mtok_usd=0.25)
FAST = Price(input_per_mtok_usd=0.5, output_per_mtok_usd=1.5)  # no cached price: a tenth of the input's
OUTPUT_TOKENS = 8  # every fake answer's


async def _spent(stack: Stack, tenant: str = "anonymous") -> float:
    """The tenant's settled spend of the day, once no hold is left open (a stream's settles as it ends)."""

    async def settled() -> float | None:
        day = (await stack.gateway.app[STATE].accounting.store.snapshot(tenant)).windows[Window.DAY]
        return day.spend_usd if day.reserved_usd == 0 and day.spend_usd > 0 else None

    found: float = await until(settled, what="every hold settled")
    return found


def _charged(price: Price, counted: list[Prompt]) -> list[float]:
    return [price.cost_usd(p.tokens, OUTPUT_TOKENS, cached_tokens=p.cached) for p in counted]


async def _cached_stack(fake_pair: Any, make_stack: Callable[..., Any], **settings: Any) -> Stack:
    """The two fakes with prefix caches, hq priced with an explicit cached price, fast with the default one."""
    hq, hq_server, fast, fast_server = fake_pair
    hq.prefix_cache = fast.prefix_cache = True
    deployments = policy_data(str(hq_server.make_url("")).rstrip("/"),
                              str(fast_server.make_url("")).rstrip("/"))["deployments"]
    deployments["hq"]["price"] = HQ.model_dump(exclude={"cached_input_fraction"})
    budget = [{"name": "anonymous", "budgets": [{"window": "day", "hard_usd": 100}]}]  # its spend is then kept
    stack: Stack = await make_stack({"deployments": deployments, "tenants": budget}, settings=settings)
    return stack


@pytest.fixture
async def cached_stack(fake_pair: Any, make_stack: Callable[..., Any]) -> Stack:
    return await _cached_stack(fake_pair, make_stack)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_agent_sessions_cached_prefix_is_charged_at_the_cached_price(cached_stack: Stack,
                                                                              stream: bool) -> None:
    stack = cached_stack
    async with stack.client() as client:
        await Agent(client, "cached-run", stream=stream).run(4)  # tools: every step to hq
    counted = stack.hq.counted
    assert len(counted) == 4 and counted[0].cached == 0
    # each step re-sends the conversation so far: all but the newest messages come from the cache
    assert all(0 < p.cached < p.tokens for p in counted[1:]), counted
    charged = sum(_charged(HQ, counted))
    uncached = sum(HQ.cost_usd(p.tokens, OUTPUT_TOKENS, cached_tokens=0) for p in counted)
    assert uncached - charged == pytest.approx(sum(p.cached for p in counted) * (3 - 0.25) / 1e6)
    assert await _spent(stack) == pytest.approx(charged, rel=1e-6)
    session = await recorded(str(stack.gateway.make_url("")).rstrip("/"), "cached-run", 4)
    assert [s["tokens_cached"] for s in session["steps"]] == [p.cached for p in counted]
    assert [s["cost_usd"] for s in session["steps"]] == pytest.approx(_charged(HQ, counted))
    assert session["cost_usd"] == pytest.approx(charged)
    assert await metric(stack.gateway, "gateway_cached_tokens_total", deployment="hq") == sum(p.cached for p in counted)
    assert await metric(stack.gateway, "gateway_spend_usd_total", deployment="hq") == pytest.approx(charged)
    assert await metric(stack.gateway, "gateway_usage_cached_overstated_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_anthropic_sdk_sees_cache_read_input_tokens(cached_stack: Stack, stream: bool) -> None:
    stack = cached_stack
    conversation: list[dict[str, Any]] = [{"role": "user", "content": "List the files in the repository."}]
    usages = []
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        for turn in range(3):
            if stream:
                async with client.messages.stream(model="fast", max_tokens=64, messages=conversation) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(model="fast", max_tokens=64, messages=conversation)
            usages.append(message.usage)
            conversation += [{"role": "assistant", "content": message.content[0].text},  # type: ignore[union-attr]
                             {"role": "user", "content": f"And the tests, part {turn}?"}]
    counted = stack.fast.counted
    assert [u.cache_read_input_tokens or 0 for u in usages] == [p.cached for p in counted]
    assert [u.input_tokens + (u.cache_read_input_tokens or 0) for u in usages] == [p.tokens for p in counted]
    assert all(p.cached > 0 for p in counted[1:])
    assert await _spent(stack) == pytest.approx(sum(_charged(FAST, counted)), rel=1e-6)


async def test_a_deployment_claiming_more_cached_tokens_than_its_prompt_is_clamped_and_counted(
        cached_stack: Stack) -> None:
    stack = cached_stack
    stack.fast.cached_figure = 10_000
    async with stack.client() as client:
        answer = await client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.prompt_tokens < 10_000  # what the client got, untouched
    prompt = stack.fast.counted[0].tokens
    assert await _spent(stack) == pytest.approx(FAST.cost_usd(prompt, OUTPUT_TOKENS, cached_tokens=prompt))
    assert await metric(stack.gateway, "gateway_usage_cached_overstated_total", deployment="fast") == 1
    assert await metric(stack.gateway, "gateway_cached_tokens_total", deployment="fast") == prompt


async def test_a_garbled_cached_figure_charges_every_prompt_token_as_new(cached_stack: Stack) -> None:
    stack = cached_stack
    stack.fast.cached_figure = "lots"
    async with stack.client() as client:
        answer = await client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    prompt = stack.fast.counted[0].tokens
    assert await _spent(stack) == pytest.approx(FAST.cost_usd(prompt, OUTPUT_TOKENS, cached_tokens=0))


def test_the_fakes_prefix_cache_is_per_server() -> None:
    first, second = FakeVLLM("a", prefix_cache=True), FakeVLLM("b", prefix_cache=True)
    body = {"messages": [{"role": "user", "content": "one two three"}]}
    longer = {"messages": [{"role": "user", "content": "one two three"}, {"role": "user", "content": "four"}]}
    assert first._prompt(body).cached == 0
    seen = first._prompt(longer)
    assert 0 < seen.cached < seen.tokens
    assert second._prompt(longer).cached == 0  # the other deployment never read it


async def test_the_request_log_and_policy_simulate_price_the_cached_tokens(
        fake_pair: Any, make_stack: Callable[..., Any], tmp_path: Path) -> None:
    log_path = tmp_path / "requests.jsonl"
    stack = await _cached_stack(fake_pair, make_stack, request_log=str(log_path))
    async with stack.client() as client:
        await Agent(client, "logged-run").run(3)
    lines = await until(lambda: log_path.exists() and len(rows := log_path.read_text().splitlines()) == 3 and rows,
                        what="three log lines")
    counted = stack.hq.counted
    logged = [json.loads(line) for line in lines]
    assert [r["usage"]["cached_tokens"] for r in logged] == [p.cached for p in counted]
    assert [r["cost_usd"] for r in logged] == pytest.approx(_charged(HQ, counted))
    # replayed: at the logged cached count, at each policy's cached price
    live = policy_module.load(str(stack.policy_path))
    assert simulate.replay(str(log_path), live, None)["tallies"]["live"]["cost_usd"] == \
        pytest.approx(sum(_charged(HQ, counted)))
    dearer = policy_data("http://hq", "http://fast")
    dearer["deployments"]["hq"]["price"] = {"input_per_mtok_usd": 3, "output_per_mtok_usd": 15,
                                            "cached_input_fraction": 0.5}
    candidate_path = tmp_path / "candidate.yaml"
    candidate_path.write_text(yaml.safe_dump(dearer))
    replayed = simulate.replay(str(log_path), policy_module.load(str(candidate_path)), None)
    dearer_price = Price(input_per_mtok_usd=3, output_per_mtok_usd=15, cached_input_fraction=0.5)
    assert replayed["tallies"]["candidate"]["cost_usd"] == pytest.approx(sum(_charged(dearer_price, counted)))
