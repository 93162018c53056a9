"""The pure admission verdict, the worst-case estimate, and Budgets' 429s and idempotent settle/release."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.accounting.budgets import Budgets, usage_report
from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.usage import Usage
from gateway.decision.admission import (
    Cost,
    SessionState,
    TenantSnapshot,
    WindowUsage,
    admission,
    window_bucket,
    worst_case,
)
from gateway.errors import RateLimited
from gateway.policy.model import Deployment, Price
from gateway.policy.tenancy import AboveSoft, Budget, SessionPolicy, TenantPolicy, Window, find_tenant
from gateway.store.memory import MemoryStore

NOW = 1_800_000_030.0  # 30 s into a minute
COSTS = {"hq": Cost(0.30, 3000), "fast": Cost(0.03, 3000)}


def snap(
    usd: float = 0.0, tokens: int = 0, requests: int = 0, concurrent: int = 0, window: Window = Window.DAY
) -> TenantSnapshot:
    ends = window_bucket(window, NOW)[1]
    usage = WindowUsage(window, spend_usd=usd, tokens=tokens, requests=requests, ends_at_s=ends)
    minute = usage if window is Window.MINUTE else WindowUsage(Window.MINUTE, ends_at_s=NOW + 30)
    return TenantSnapshot("acme", NOW, {window: usage, Window.MINUTE: minute}, concurrent)


def tenant(**kw: object) -> TenantPolicy:
    return TenantPolicy(name="acme", **kw)  # type: ignore[arg-type]


DAY_BUDGET = (Budget(window=Window.DAY, soft_usd=5.0, hard_usd=10.0),)


@pytest.mark.parametrize(
    ("spent", "allowed", "prefer", "limit"),
    [
        (0.0, {"hq", "fast"}, None, None),
        (5.0, {"hq", "fast"}, "fast", "usd_per_day"),  # soft: steer to fast
        (9.8, {"fast"}, "fast", "usd_per_day"),  # hq's worst case would cross hard
        (9.99, set(), None, "usd_per_day"),  # nothing fits: 429
    ],
)
def test_usd_budget_levels(spent: float, allowed: set[str], prefer: str | None, limit: str | None) -> None:
    verdict = admission(snap(usd=spent), tenant(budgets=DAY_BUDGET), COSTS)
    assert (set(verdict.allowed), verdict.prefer, verdict.limit) == (allowed, prefer, limit)
    if not allowed:
        assert verdict.refused and verdict.retry_after_s == pytest.approx(window_bucket(Window.DAY, NOW)[1] - NOW)


def test_refuse_hq_above_soft() -> None:
    policy = tenant(budgets=DAY_BUDGET, above_soft=AboveSoft(route_to=None, refuse=("hq",)))
    verdict = admission(snap(usd=6.0), policy, COSTS)
    assert (set(verdict.allowed), verdict.prefer) == ({"fast"}, None)


def test_token_budget_and_rates() -> None:
    policy = tenant(
        budgets=(Budget(window=Window.HOUR, hard_tokens=10_000),), requests_per_minute=10, max_concurrent=2
    )
    assert not admission(snap(tokens=8000, window=Window.HOUR), policy, COSTS).allowed
    rpm = admission(snap(requests=10, window=Window.MINUTE), policy, COSTS)
    assert (rpm.limit, rpm.retry_after_s) == ("requests_per_minute", 30.0)
    conc = admission(snap(concurrent=2), policy, COSTS)
    assert (conc.allowed, conc.limit, conc.retry_after_s) == (frozenset(), "concurrent", 1.0)


def test_tokens_per_minute() -> None:
    verdict = admission(snap(tokens=8000, window=Window.MINUTE), tenant(tokens_per_minute=10_000), COSTS)
    assert (verdict.allowed, verdict.limit) == (frozenset(), "tokens_per_minute")


def test_max_cost_header_keeps_the_cheapest() -> None:
    assert set(admission(snap(), None, COSTS, max_cost_usd=0.1).allowed) == {"fast"}
    verdict = admission(snap(), None, COSTS, max_cost_usd=0.001)
    assert set(verdict.allowed) == {"fast"} and "cheapest" in verdict.reasons[-1]


def test_session_cap_tight_loop_and_pin() -> None:
    sessions = SessionPolicy(pin=True, tight_loop_steps_per_min=20, cost_cap_usd=1.0)
    capped = admission(snap(), None, COSTS, session=SessionState("s", cost_usd=1.0), sessions=sessions)
    assert (capped.refused, capped.limit) == (True, "session_usd")
    looping = SessionState("s", steps=40, steps_per_min=30, pinned="hq")
    assert admission(snap(), None, COSTS, session=looping, sessions=sessions).prefer == "fast"
    calm = SessionState("s", steps=3, steps_per_min=2, pinned="hq")
    assert admission(snap(), None, COSTS, session=calm, sessions=sessions).prefer == "hq"
    # a budget that says fast beats the pin
    soft = admission(snap(usd=5.0), tenant(budgets=DAY_BUDGET), COSTS, session=calm, sessions=sessions)
    assert soft.prefer == "fast"


def test_find_tenant_falls_back_to_template() -> None:
    tenants = [tenant(max_concurrent=1), TenantPolicy(name="*", max_concurrent=9)]
    assert find_tenant(tenants, "acme") is tenants[0]
    assert find_tenant(tenants, "globex") is tenants[1]
    assert find_tenant(tenants[:1], "globex") is None


def test_policy_sections_validate() -> None:
    with pytest.raises(ValidationError):
        Budget(window=Window.DAY, soft_usd=5, hard_usd=1)
    with pytest.raises(ValidationError):
        tenant(budgets=(Budget(window=Window.DAY), Budget(window=Window.DAY)))
    with pytest.raises(ValidationError):
        tenant(unknown_field=1)
    with pytest.raises(ValidationError):
        TenantPolicy(name="bad name{}")


def test_month_bucket_is_the_calendar_month() -> None:
    dec_31 = 1798761599.0  # 2026-12-31T23:59:59Z
    assert window_bucket(Window.MONTH, dec_31) == ("202612", 1798761600.0)
    assert window_bucket(Window.MONTH, dec_31 + 1)[0] == "202701"


def test_worst_case_uses_max_tokens_or_the_deployment_cap() -> None:
    dep = Deployment(
        url="http://x", served_model="m", price=Price(input_per_mtok_usd=3, output_per_mtok_usd=15),
        default_max_tokens=1000, max_model_len=4096,
    )  # fmt: skip
    assert worst_case(dep, 1000, 200) == Cost(pytest.approx(0.006), 1200)
    assert worst_case(dep, 1000, None) == Cost(pytest.approx(0.018), 2000)
    assert worst_case(dep, 4000, 5000).tokens == 4096  # cannot generate past the context window
    assert worst_case(dep, 1000, 200, choices=3) == Cost(pytest.approx(0.012), 1600)


CAPS_POLICY = """
version: 1
deployments:
  hq: {url: "http://127.0.0.1:1", served_model: a, max_model_len: 600, default_max_tokens: 1000,
       price: {input_per_mtok_usd: 1, output_per_mtok_usd: 10}}
  fast: {url: "http://127.0.0.1:2", served_model: b, default_max_tokens: 256}
models: {auto: {route: rules}}
default: fast
"""


def _plan(body: dict[str, Any], endpoint: str = "chat", policy_text: str = CAPS_POLICY) -> Any:
    from gateway.decision.admission import output_plan, prompt_size
    from gateway.features import extract
    from gateway.policy.model import parse

    features = extract(body, endpoint)
    return output_plan(parse(policy_text, "p.yaml"), features, prompt_size(features, len(json_body.encode(body))))


def test_the_worst_case_counts_every_choice_and_the_cap_it_assumes_is_sent() -> None:
    from gateway.decision.admission import costs_of
    from gateway.features import extract
    from gateway.policy.model import parse

    assert chat_wire.choices_of({"n": 3}, "chat") == 3
    assert chat_wire.choices_of({"n": 2, "best_of": 5}, "completions") == 5
    assert chat_wire.choices_of({"prompt": ["a", "b"], "n": 2}, "completions") == 4
    assert chat_wire.choices_of({"prompt": [1, 2, 3]}, "completions") == 1  # one tokenized prompt
    assert chat_wire.choices_of({"n": True, "best_of": "9"}, "chat") == 1
    policy = parse(CAPS_POLICY, "p.yaml")
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    features = extract(body, "chat")
    assert _plan(body).caps == {"hq": 600 - features.prompt_tokens, "fast": 256}  # within hq's context window
    prompt = features.prompt_tokens + 16  # billed with the chat template's wrapping
    hq_usd = (prompt + 3 * (600 - features.prompt_tokens) * 10) / 1e6
    assert costs_of(policy, features, 100, 3)["hq"].usd == pytest.approx(hq_usd)
    # the request's own cap is the cap, and it is sent too, so the hold never rests on the client's field
    assert _plan({**body, "max_tokens": 5}).caps == {"hq": 5, "fast": 5}
    capped = {**body, "model": "a", "max_completion_tokens": 256}
    assert chat_wire.upstream_body(body, "a", 256)[0] == json_body.encode(capped)
    completion = {"model": "auto", "prompt": "hi"}
    assert b'"max_tokens":7' in chat_wire.upstream_body(completion, "a", 7)[0]


@pytest.mark.parametrize(
    ("endpoint", "body", "obeyed"),
    [
        # vLLM's chat reads max_completion_tokens, else the deprecated max_tokens
        ("chat", {"max_completion_tokens": 1, "max_tokens": 300}, 1),
        ("chat", {"max_tokens": 300}, 300),
        # vLLM's completions reads max_tokens only: a max_completion_tokens there is ignored
        ("completions", {"max_completion_tokens": 1, "max_tokens": 300}, 300),
        ("completions", {"max_completion_tokens": 1}, None),
        ("embeddings", {"max_tokens": 3}, None),
    ],
)
def test_the_output_cap_is_the_one_the_deployment_obeys(
    endpoint: str, body: dict[str, Any], obeyed: int | None
) -> None:
    from gateway.features import extract

    shape = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    full = {"model": "auto", **shape, **body}
    assert chat_wire.output_cap(full, endpoint) == obeyed
    assert extract(full, endpoint).max_tokens == obeyed
    if endpoint == "embeddings":
        return
    caps = _plan(full, endpoint).caps
    assert caps["fast"] == (obeyed if obeyed is not None else 256)  # held for what it will generate…
    sent = json_body.decode(chat_wire.upstream_body(full, "b", caps["fast"], endpoint=endpoint)[0])
    assert chat_wire.output_cap(sent, endpoint) == caps["fast"]  # …and sent so that the deployment obeys it


def test_a_long_prompt_is_held_with_a_cap_sized_by_its_count_not_its_bytes() -> None:
    """A prompt past the exact-count budget is billed by its bytes, but its room in a context window is
    sized by a count (the bytes are ~4x its tokens): the cap is sent and held, neither zero nor tiny."""
    from gateway.decision.admission import costs_of, measure_prompt, output_plan, prompt_size
    from gateway.features import extract
    from gateway.policy.model import parse

    policy = parse(CAPS_POLICY.replace("max_model_len: 600", "max_model_len: 32768"), "p.yaml")
    body = {"model": "auto", "messages": [{"role": "user", "content": "the quick brown fox jumps. " * 1500}]}
    features, body_bytes = extract(body, "chat"), len(json_body.encode(body))
    assert not features.prompt_tokens_exact and body_bytes > 40_000
    measured = measure_prompt(policy, features, body, body_bytes)
    assert measured.counted and measured.floor < 10_000 < body_bytes
    assert output_plan(policy, features, measured).caps["hq"] == 1000  # the default cap, not max(0, 32768 - bytes)
    big = {**body, "max_tokens": 30_000}
    features = extract(big, "chat")
    measured = measure_prompt(policy, features, big, body_bytes)
    cap = output_plan(policy, features, measured).caps["hq"]
    assert cap == 32768 - measured.floor and cap > 20_000  # the room the window really leaves
    assert costs_of(policy, features, body_bytes, prompt=measured)["hq"].tokens == measured.ceiling + cap
    # without a count, the floor is 0: the cap is the request's own (finite, never 0); the hold covers it
    unknown = prompt_size(features, body_bytes)
    assert output_plan(policy, features, unknown).caps["hq"] == 30_000


def test_a_window_without_useful_room_is_a_clear_refusal_not_a_truncation() -> None:
    from gateway.decision.admission import Admission, fit_room, output_plan, prompt_size
    from gateway.errors import ContextTooLong
    from gateway.features import extract
    from gateway.policy.model import parse

    policy = parse(CAPS_POLICY.replace("max_model_len: 600", "max_model_len: 64"), "p.yaml")
    body = {"model": "auto", "messages": [{"role": "user", "content": "word " * 60}]}
    features = extract(body, "chat")
    plan = output_plan(policy, features, prompt_size(features, 400))
    assert "hq" in plan.roomless and "max_model_len 64" in plan.roomless["hq"]
    verdict = fit_room(Admission(frozenset({"hq", "fast"}), prefer="hq"), plan, policy, features)
    assert verdict.allowed == {"fast"} and verdict.prefer is None
    assert any("hq: a prompt of at least" in why for why in verdict.reasons)
    with pytest.raises(ContextTooLong, match="max_model_len 64"):
        fit_room(Admission(frozenset({"hq"})), plan, policy, features)
    # a request that asks for only a few tokens is served where they fit
    small = extract({**body, "max_tokens": 2}, "chat")
    assert output_plan(policy, small, prompt_size(small, 400)).roomless == {}


async def test_budgets_raise_429_with_limit_and_retry_after() -> None:
    budgets = Budgets(MemoryStore())
    policy = tenant(budgets=(Budget(window=Window.MINUTE, hard_usd=0.1),))
    await budgets.reserve("acme", policy, "hq", Cost(0.08, 10))
    with pytest.raises(RateLimited) as info:
        await budgets.reserve("acme", policy, "hq", Cost(0.08, 10))
    err = info.value
    assert (err.status, err.code) == (429, "budget_exceeded")
    assert "usd_per_minute" in err.message and 1 <= int(err.headers["Retry-After"]) <= 60


async def test_settle_and_release_are_idempotent() -> None:
    store = MemoryStore()
    budgets = Budgets(store)
    price = Price(input_per_mtok_usd=1.0, output_per_mtok_usd=2.0)
    held = await budgets.reserve("acme", None, "hq", Cost(0.5, 10))
    await budgets.settle(held, price, Usage(1000, 1000))
    await budgets.settle(held, price, Usage(1000, 1000))
    await budgets.release(held)
    day = (await store.snapshot("acme")).windows[Window.DAY]
    assert (day.spend_usd, day.reserved_usd, day.tokens) == (0.003, 0.0, 2000)
    report = await usage_report(store, "acme")
    assert report["object"] == "usage"
    assert {"tenant": "acme", "window": "day", "deployment": "hq", "spend_usd": 0.003}.items() <= next(
        r for r in report["data"] if r["window"] == "day" and r["deployment"] == "hq"
    ).items()


async def test_a_hold_around_background_work_is_settled_at_its_usage_or_released() -> None:
    import asyncio

    store = MemoryStore()
    budgets = Budgets(store)
    price = Price(input_per_mtok_usd=1.0, output_per_mtok_usd=2.0)

    async def day() -> tuple[float, float, int]:
        window = (await store.snapshot("acme")).windows[Window.DAY]
        return window.spend_usd, window.reserved_usd, window.tokens

    async with budgets.holding("acme", None, "fast", Cost(0.5, 10), price) as charge:
        assert (await day())[1] == 0.5  # held while the work runs
        charge.usage = Usage(1000, 1)
    assert await day() == (0.001002, 0.0, 1001)  # charged at what the deployment reported
    with pytest.raises(ValueError, match="the work failed"):
        async with budgets.holding("acme", None, "fast", Cost(0.5, 10), price):
            raise ValueError("the work failed")
    assert await day() == (0.001002, 0.0, 1001)  # given back whole

    async def cancelled() -> None:
        async with budgets.holding("acme", None, "fast", Cost(0.5, 10), price):
            await asyncio.sleep(3600)

    task = asyncio.create_task(cancelled())
    while (await day())[1] == 0.0:  # wait until the hold is taken
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await day() == (0.001002, 0.0, 1001)  # a cancel (the gateway stopping) gives it back too
    policy = tenant(budgets=(Budget(window=Window.MINUTE, hard_usd=0.1),))
    with pytest.raises(RateLimited):  # refused before any work starts
        async with budgets.holding("acme", policy, "fast", Cost(0.5, 10), price):
            raise AssertionError("the work ran without a hold")
