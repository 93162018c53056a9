"""Tenants, keys, budgets and sessions on the request path, with the embedded store (one gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from fakes.faulty_vllm import Fault
from gateway.accounting import keys
from gateway.accounting.ledger import Accounting
from gateway.cli.command import main
from gateway.policy import model as policy_module
from gateway.policy.tenancy import Window
from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric

HELLO = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# The fake deployments report 11 prompt and 8 completion tokens for every call.
HQ_CALL_USD = (11 * 3 + 8 * 15) / 1e6


def _accounting(stack: Stack) -> Accounting:
    return stack.gateway.app[STATE].accounting


async def _chat(
    stack: Stack, *, headers: dict[str, str] | None = None, api_key: str = "sk-client-secret", **body: Any
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    payload = {"model": "auto", "messages": HELLO, **body}
    sent = {"Authorization": f"Bearer {api_key}", **(headers or {})}
    async with (
        aiohttp.ClientSession() as http,
        http.post(stack.base_url + "/chat/completions", json=payload, headers=sent) as resp,
    ):
        return resp.status, await resp.json(), resp.headers.copy()


async def _explained(stack: Stack, request_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(stack.gateway.make_url(f"/admin/requests/{request_id}/explain"), headers=ADMIN) as resp,
    ):
        return dict(await resp.json())


async def _reasons(stack: Stack, request_id: str) -> list[str]:
    return list((await _explained(stack, request_id))["reasons"])


async def _day(stack: Stack, tenant: str = "anonymous") -> tuple[float, float]:
    """(settled spend, reserved) of the tenant's current day."""
    snap = await _accounting(stack).store.snapshot(tenant)
    day = snap.windows[Window.DAY]
    return day.spend_usd, day.reserved_usd


async def test_soft_limit_routes_to_fast_and_says_why(make_stack: Any) -> None:
    stack: Stack = await make_stack("""
        tenants:
          - name: anonymous
            budgets: [{window: day, soft_usd: 0.0001}]
    """)
    status, _, first = await _chat(stack, tools=TOOLS)
    assert status == 200 and first["x-gateway-deployment"] == "hq"
    status, _, second = await _chat(stack, tools=TOOLS)
    assert status == 200 and second["x-gateway-deployment"] == "fast"
    reasons = await _reasons(stack, second["x-request-id"])
    assert any("soft limit usd_per_day crossed" in r for r in reasons), reasons
    assert (await _day(stack))[0] == pytest.approx(HQ_CALL_USD + (11 * 0.5 + 8 * 1.5) / 1e6)


async def test_cost_cap_header_below_hq_worst_case_uses_fast(stack: Stack) -> None:
    # HQ's worst case without max_tokens is about 1024 tokens at 15 USD/Mtok, fast's a tenth of that
    status, _, capped = await _chat(stack, tools=TOOLS, headers={"x-gateway-max-cost-usd": "0.005"})
    assert status == 200 and capped["x-gateway-deployment"] == "fast"
    assert any("x-gateway-max-cost-usd" in r for r in await _reasons(stack, capped["x-request-id"]))
    status, _, roomy = await _chat(stack, tools=TOOLS, headers={"x-gateway-max-cost-usd": "1"})
    assert status == 200 and roomy["x-gateway-deployment"] == "hq"
    status, body, _ = await _chat(stack, headers={"x-gateway-max-cost-usd": "lots"})
    assert status == 400 and body["error"]["param"] == "x-gateway-max-cost-usd"


async def test_tight_agent_loop_prefers_fast(make_stack: Any) -> None:
    stack: Stack = await make_stack("""
        sessions: {tight_loop_steps_per_min: 30, rate_window_s: 10}
    """)
    served = []
    for _ in range(7):  # 6 steps in 10 s is 36 steps/min
        status, _, headers = await _chat(stack, tools=TOOLS, headers={"x-session-id": "loop-1"})
        assert status == 200
        served.append(headers["x-gateway-deployment"])
    assert served[:5] == ["hq"] * 5 and served[-1] == "fast"
    _, _, other = await _chat(stack, tools=TOOLS, headers={"x-session-id": "calm-2"})
    assert other["x-gateway-deployment"] == "hq"


async def test_session_pin_and_cost_cap(make_stack: Any) -> None:
    stack: Stack = await make_stack(f"""
        sessions: {{pin: true, cost_cap_usd: {HQ_CALL_USD * 1.5}}}
    """)
    session = {"x-session-id": "agent-7"}
    status, _, first = await _chat(stack, tools=TOOLS, headers=session)
    assert status == 200 and first["x-gateway-deployment"] == "hq"
    status, _, second = await _chat(stack, headers=session)  # no tools: the rules alone would pick fast
    assert status == 200 and second["x-gateway-deployment"] == "hq"
    explained = await _explained(stack, second["x-request-id"])
    assert any("session pinned to hq" in r for r in explained["reasons"])
    assert (explained["session"]["id"], explained["session"]["pinned"]) == ("agent-7", "hq")  # the client's id
    status, body, third = await _chat(stack, headers=session)
    assert status == 429 and body["error"]["code"] == "budget_exceeded"
    assert "session" in body["error"]["message"] and int(third["Retry-After"]) >= 1
    status, _, _ = await _chat(stack, headers={"x-session-id": "agent-8"})
    assert status == 200


async def test_conversations_that_open_alike_do_not_share_a_session_cap(make_stack: Any) -> None:
    stack: Stack = await make_stack(f"""
        sessions: {{cost_cap_usd: {HQ_CALL_USD * 1.5}}}
    """)
    opening = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix it"}]
    for _ in range(4):  # many agents start alike: first steps share nothing, however many there are
        status, _, _ = await _chat(stack, model="hq", messages=opening)
        assert status == 200

    def step(reply: str) -> list[dict[str, Any]]:
        return [*opening, {"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]

    for expected in (200, 200, 429):  # one conversation spends past its cap…
        status, _, _ = await _chat(stack, model="hq", messages=step("Reading main.py"))
        assert status == expected
    status, _, _ = await _chat(stack, model="hq", messages=step("Running the tests"))
    assert status == 200  # …and another that opened the same way goes on


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_session_is_pinned_to_the_deployment_that_answered_after_failover(
    make_stack: Any, request: pytest.FixtureRequest, store: str
) -> None:
    extra = "sessions: {pin: true}\n"
    if store == "redis":
        extra += f'store: {{redis_url: "{request.getfixturevalue("redis_server").url}"}}\n'
    stack: Stack = await make_stack(extra)
    session = {"x-session-id": f"pin-{uuid.uuid4().hex}"}
    stack.fast.faults.append(Fault(status=503))
    status, _, first = await _chat(stack, headers=session)  # the rules pick fast; it fails; hq answers
    assert status == 200 and first["x-gateway-deployment"] == "hq"
    status, _, second = await _chat(stack, headers=session)
    assert status == 200 and second["x-gateway-deployment"] == "hq"
    assert any("session pinned to hq" in r for r in await _reasons(stack, second["x-request-id"]))


async def _clear_of_a_minute_boundary(margin_s: float = 5.0) -> None:
    """Budget windows are calendar minutes: a test whose figures must stay in one waits out a near boundary."""
    into_minute = time.time() % 60
    if into_minute > 60 - margin_s:
        await asyncio.sleep(60 - into_minute + 0.1)


async def test_hard_limit_is_429_in_the_openai_envelope(make_stack: Any) -> None:
    await _clear_of_a_minute_boundary()
    stack: Stack = await make_stack("""
        tenants:
          - name: "*"
            budgets: [{window: minute, hard_usd: 0.0004}]
    """)
    async with stack.client() as client:
        await client.chat.completions.create(model="hq", messages=HELLO, max_tokens=8)
        with pytest.raises(openai.RateLimitError) as caught:
            for _ in range(5):
                await client.chat.completions.create(model="hq", messages=HELLO, max_tokens=8)
    err = caught.value
    assert err.body["code"] == "budget_exceeded" and "usd_per_minute" in err.body["message"]  # type: ignore[index]
    assert 1 <= int(err.response.headers["Retry-After"]) <= 60
    spend, reserved = await _day(stack)
    assert reserved == 0 and spend <= 0.0004


async def test_streamed_usage_settles_and_failures_release(make_stack: Any) -> None:
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
    """)
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="hq", messages=HELLO, stream=True)
        _ = [chunk async for chunk in stream]
        assert await _day(stack) == (pytest.approx(HQ_CALL_USD), 0)
        stack.hq.faults += [Fault(status=500)]
        stack.fast.faults += [Fault(status=500)]
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="hq", messages=HELLO)
    assert await _day(stack) == (pytest.approx(HQ_CALL_USD), 0)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The gateway's store: the embedded one, or a real redis-server of the test's own."""
    if request.param == "memory":
        return {}
    server: RedisServer = request.getfixturevalue("private_redis")
    return {"redis_url": server.url}


async def _settled(stack: Stack) -> tuple[float, int]:
    """Once no hold is left: the day's spend and the output tokens charged on fast."""
    async def no_hold() -> bool:
        return (await _day(stack))[1] == 0

    await until(no_hold, what="every hold settled")
    spend, _ = await _day(stack)
    rows = await _accounting(stack).store.usage("anonymous")
    out = sum(r.tokens_out for r in rows if r.window is Window.DAY and r.deployment == "fast")
    return spend, out


async def test_a_client_that_disconnects_mid_stream_is_charged_what_was_streamed(
    make_stack: Any, store_settings: dict[str, Any]
) -> None:
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
    """, settings=store_settings)
    stack.fast.chunks, stack.fast.chunk_delay_s = 64, 0.02
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.base_url + "/chat/completions", json={"model": "fast", "messages": HELLO, "stream": True}
        )
        events = 0
        while events < 16:  # read 16 of 64 chunks, then hang up
            events += (await resp.content.readline()).startswith(b"data: ")
        assert (await _day(stack))[1] > 0
        resp.close()
    spend, out = await _settled(stack)
    assert 16 <= out < 64  # the chunks the gateway relayed (or had read), each one token, never the rest
    assert spend > 0 and spend == pytest.approx(_fast_cost(out), rel=1e-6)


async def test_a_client_that_leaves_a_non_streamed_call_is_charged_its_prompt(
    make_stack: Any, store_settings: dict[str, Any]
) -> None:
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
    """, settings=store_settings)
    stack.fast.faults += [Fault(stall_s=5)]  # the deployment has the request and is still working on it
    async with aiohttp.ClientSession() as http:
        call = asyncio.ensure_future(http.post(stack.base_url + "/chat/completions",
                                               json={"model": "fast", "messages": HELLO}))
        await until(lambda: stack.fast.received, what="the deployment received the call")
        call.cancel()  # the client hangs up before the answer
        with contextlib.suppress(asyncio.CancelledError):
            await call
    spend, out = await _settled(stack)
    assert out == 0 and spend == pytest.approx(_fast_cost(0), rel=1e-6) and spend > 0  # before: released, $0


async def test_a_deployment_that_dies_mid_stream_is_charged_what_it_streamed(
    make_stack: Any, store_settings: dict[str, Any]
) -> None:
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
        resume: {enabled: false}
    """, settings=store_settings)
    stack.fast.faults += [Fault(drop_after_chunks=5)]
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        with pytest.raises(openai.APIError):
            _ = [chunk async for chunk in stream]
    spend, out = await _settled(stack)
    assert 5 <= out <= 7  # "tok " five times: five chunks, six cl100k tokens
    assert spend == pytest.approx(_fast_cost(out), rel=1e-6)


async def test_a_stream_cut_before_its_first_event_is_charged_its_prompt(
    make_stack: Any, store_settings: dict[str, Any]
) -> None:
    """vLLM sends a stream's headers at once: a stream cut after them (here the deployment dies before its first
    event) had the deployment take the prompt in, and is charged it, not released at $0."""
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
        resume: {enabled: false}
    """, settings=store_settings)
    stack.fast.faults += [Fault(drop_after_chunks=0)]
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        with pytest.raises(openai.APIError):
            _ = [chunk async for chunk in stream]
    spend, out = await _settled(stack)
    assert out == 0 and spend == pytest.approx(_fast_cost(0), rel=1e-6) and spend > 0


def test_stream_tally_counts_text_tool_calls_and_events_past_its_kept_bytes() -> None:
    from gateway.apis.chat.wire import TALLY_KEPT_BYTES, StreamTally
    from gateway.features import count_tokens

    def event(delta: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"

    tally = StreamTally()
    tally.add(event({"role": "assistant", "content": ""}))  # carries no token
    tally.add(event({"content": "The quick brown fox jumps"}) + event({"content": " over"}))  # several per chunk
    tally.add(event({"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": "{}"}}]}))
    expected = count_tokens("The quick brown fox jumps overget_weather{}")
    assert tally.completion_tokens(count_tokens) == expected > 3
    tally.add(b"x" * TALLY_KEPT_BYTES)  # past the kept bytes, each event counts one token
    tally.add(event({"content": "a"}) * 10)
    assert tally.completion_tokens(count_tokens) == expected + 10


def _fast_cost(tokens_out: int) -> float:
    """What fast charges for HELLO's prompt as the gateway counts it, plus `tokens_out`."""
    from gateway.features import extract, prompt_tokens_with_template

    prompt = prompt_tokens_with_template(extract({"model": "fast", "messages": HELLO}, "chat"))
    return (prompt * 0.5 + tokens_out * 1.5) / 1e6


async def test_a_call_without_max_tokens_goes_upstream_with_the_cap_its_hold_assumed(make_stack: Any) -> None:
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
    """)
    status, _, _ = await _chat(stack, model="fast")
    assert status == 200 and stack.fast.received[-1]["max_completion_tokens"] == 1024
    status, _, _ = await _chat(stack, model="fast", max_tokens=8)  # the client's own cap, untouched
    assert status == 200 and stack.fast.received[-1]["max_tokens"] == 8
    assert "max_completion_tokens" not in stack.fast.received[-1]
    async with stack.client() as client:
        await client.completions.create(model="fast", prompt="hello there")
    assert stack.fast.received[-1]["max_tokens"] == 1024
    spend, reserved = await _day(stack)
    assert reserved == 0 and spend > 0


async def test_a_completions_call_is_held_for_the_max_tokens_vllm_obeys(make_stack: Any) -> None:
    """vLLM's completions endpoint reads max_tokens alone: a max_completion_tokens of 1 beside a max_tokens of
    300 generates 300, so the hold is for 300 (fast at 1.5 USD/Mtok: ~460 µUSD, over this 100 µUSD limit)."""
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 0.0001}]}]
    """)
    body = {"model": "fast", "prompt": "hello there", "max_completion_tokens": 1}
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/completions", json={**body, "max_tokens": 300}) as resp:
            assert resp.status == 429, await resp.text()
            assert "usd_per_day" in (await resp.json())["error"]["message"]
        async with http.post(stack.base_url + "/completions", json={**body, "max_tokens": 2}) as resp:
            assert resp.status == 200
    assert stack.fast.received[-1]["max_tokens"] == 2


async def _long_context(stack: Stack, max_model_len: int, names: tuple[str, ...] = ("fast",)) -> None:
    """Give deployments a context window (the policy reloads live)."""
    from gateway.server.resources import STATE

    policy = yaml.safe_load(stack.policy_path.read_text())
    for name, dep in policy["deployments"].items():
        dep.pop("max_model_len", None)
        if name in names:
            dep["max_model_len"] = max_model_len
    stack.policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
    app = stack.gateway.app
    deployments = lambda: app[STATE].policy_file.current.deployments  # noqa: E731
    await until(lambda: all(deployments()[n].max_model_len == max_model_len for n in names), what="reload")


async def test_a_long_prompt_goes_upstream_with_the_finite_cap_its_hold_assumed(make_stack: Any) -> None:
    """A prompt over the exact-count budget (40.6 KB, ~7.5k tokens): its room in a context window is sized by a
    count, not by its bytes, which leave a 32k window no room (no cap sent, a hold with no output in it) and
    a 41k one a few hundred tokens (a cap that cuts the answer off)."""
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 0.025}]}]
    """)
    long = [{"role": "user", "content": "the quick brown fox jumps. " * 1500}]
    for window in (32768, 41_000):
        await _long_context(stack, window)
        status, _, _ = await _chat(stack, model="fast", messages=long)
        assert status == 200 and stack.fast.received[-1]["max_completion_tokens"] == 1024
    # 20k tokens out at 1.5 USD/Mtok is 0.03 USD: that worst case does not fit the limit (its prompt alone does)
    status, body, _ = await _chat(stack, model="fast", messages=long, max_tokens=20_000)
    assert status == 429 and "usd_per_day" in body["error"]["message"]
    spend, reserved = await _day(stack)
    assert reserved == 0 and 0 < spend < 0.025


async def test_a_prompt_that_leaves_no_room_in_the_window_is_a_clear_400(make_stack: Any) -> None:
    """33k CJK characters: a bytes/4 guess says ~25k tokens, which fits a 30k window; counted, they are ~77k.
    The gateway refuses the call itself, naming the window, rather than sending it with no cap to a
    deployment that cannot take it."""
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]
    """)
    await _long_context(stack, 30_000, ("hq", "fast"))
    text = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(33_000))
    status, body, _ = await _chat(stack, model="fast", messages=[{"role": "user", "content": text}])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "max_model_len 30000" in body["error"]["message"]
    assert not stack.fast.received and not stack.hq.received


async def test_without_budgets_the_body_goes_upstream_without_a_cap(stack: Stack) -> None:
    status, _, _ = await _chat(stack, model="fast")
    assert status == 200 and "max_completion_tokens" not in stack.fast.received[-1]


@pytest.mark.parametrize("extra", [{"n": 4}, {"n": 1, "best_of": 4}])
async def test_the_hold_counts_every_choice(make_stack: Any, extra: dict[str, Any]) -> None:
    # fast's worst case at max_tokens 100: ~150 µUSD per choice; four choices do not fit 400 µUSD
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 0.0004}]}]
    """)
    status, body, _ = await _chat(stack, model="fast", max_tokens=100, **extra)
    assert status == 429 and "usd_per_day" in body["error"]["message"]
    status, _, _ = await _chat(stack, model="fast", max_tokens=100, n=2)
    assert status == 200


async def test_auth_keys_and_usage_endpoint(make_stack: Any) -> None:
    stack: Stack = await make_stack("""
        auth: {enabled: true}
    """)
    store = _accounting(stack).store
    _, raw = await keys.create(store, "acme")
    revoked, revoked_raw = await keys.create(store, "acme")
    await keys.revoke(store, revoked.key_id)
    for key in ("", "agk-00000000-wrong", revoked_raw):
        status, body, _ = await _chat(stack, api_key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error", key
        assert key == "" or key not in json.dumps(body)
    status, _, _ = await _chat(stack, api_key=raw, tools=TOOLS)
    assert status == 200
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.base_url + "/models") as resp:
            assert resp.status == 401
        async with http.get(stack.gateway.make_url("/admin/usage?tenant=acme"), headers=ADMIN) as resp:
            report = await resp.json()
        async with http.get(stack.gateway.make_url("/admin/usage")) as resp:
            assert resp.status == 401
    rows = {(r["window"], r["deployment"]): r for r in report["data"]}
    assert rows["day", "hq"]["spend_usd"] == pytest.approx(HQ_CALL_USD) and rows["day", "hq"]["requests"] == 1
    assert {r["tenant"] for r in report["data"]} == {"acme"}
    assert {w for w, _ in rows} == {"minute", "hour", "day", "month"}


async def test_default_policy_never_touches_the_store(stack: Stack) -> None:
    store = _accounting(stack).store
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)
    assert await store.usage() == []


def test_policy_names_unknown_deployments_in_tenancy_sections() -> None:
    text = """
version: 1
deployments:
  hq: {url: "http://127.0.0.1:1", served_model: a}
  fast: {url: "http://127.0.0.1:2", served_model: b}
models: {auto: {route: rules}, hq: {pin: hq}, fast: {pin: fast}}
default: fast
tenants:
  - name: acme
    above_soft: {route_to: cheap, refuse: [gold]}
sessions: {tight_loop_steps_per_min: 10, tight_loop_route_to: tiny}
"""
    with pytest.raises(policy_module.PolicyError) as caught:
        policy_module.parse(text, "p.yaml")
    problems = "\n".join(caught.value.problems)
    assert "p.yaml:10: tenants[0].above_soft.route_to: unknown deployment 'cheap'" in problems


def test_policy_explain_shows_budget_and_session_steers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "auto", "messages": HELLO, "tools": TOOLS}))
    example = str(Path(__file__).resolve().parents[2] / "policies" / "tenants-example.yaml")
    base = ["policy", "explain", "--policy", example, "--request", str(request), "--json"]

    def explain(*extra: str) -> dict[str, Any]:
        assert main([*base, *extra]) == 0
        return dict(json.loads(capsys.readouterr().out))

    assert explain("--tenant", "acme")["deployment"] == "hq"
    soft = explain("--tenant", "acme", "--spent-usd", "day=45")
    assert soft["deployment"] == "fast" and "admission: soft limit usd_per_day crossed" in soft["reasons"]
    assert soft["admission"]["prefer"] == "fast"
    assert explain("--session", "steps_per_min=45")["deployment"] == "fast"
    capped = explain("--header", "x-gateway-max-cost-usd:0.001")
    assert capped["deployment"] == "fast" and capped["admission"]["allowed"] == ["fast"]
    assert main([*base, "--tenant", "acme", "--spent-usd", "day=50"]) == 2
    assert "usd_per_day" in capsys.readouterr().err


async def test_near_a_hard_limit_the_chosen_deployment_goes_without_failover(make_stack: Any) -> None:
    # worst cases with max_tokens 8: fast about 21 µUSD, hq about 174; each fast call spends 17.5
    stack: Stack = await make_stack("""
        tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 0.0003}]}]
    """)
    served = 0
    for _ in range(30):
        status, body, headers = await _chat(stack, max_tokens=8)
        if status != 200:
            break
        assert headers["x-gateway-deployment"] == "fast"
        served += 1
    assert status == 429 and "usd_per_day" in body["error"]["message"]
    # holding fast+hq's failover worst case would have stopped at 8 calls; fast alone fits 16
    assert served == 16
    spend, reserved = await _day(stack)
    assert reserved == 0 and spend == pytest.approx(served * 17.5e-6)
    status, _, _ = await _chat(stack, max_tokens=1, model="hq")  # the chosen deployment must fit itself
    assert status == 429


async def test_a_call_the_hold_refuses_reached_no_deployment_and_is_no_agent_step(make_stack: Any) -> None:
    """A 429 from the budget hold is counted under no deployment (it reached none), carries the decision's rule,
    and records no agent step."""
    stack: Stack = await make_stack("""
        tenants:
          - name: anonymous
            budgets: [{window: day, hard_usd: 0.02}]
    """)
    # hq's worst case at 1,000 tokens out is about 0.016 USD: one call's hold fits the limit, two do not
    stack.hq.faults.append(Fault(hold=True))
    first = asyncio.ensure_future(_chat(stack, model="hq", max_tokens=1000))
    await until(lambda: len(stack.hq.received) == 1)
    status, body, headers = await _chat(stack, model="hq", max_tokens=1000, tools=TOOLS,
                                        headers={"x-session-id": "refused-run"})
    assert status == 429 and body["error"]["code"] == "budget_exceeded"
    assert headers["x-gateway-deployment"] == "none" and headers["x-gateway-rule"] != "none", body
    assert await metric(stack.gateway, "gateway_requests_total", deployment="none", status="429") == 1
    assert await metric(stack.gateway, "gateway_requests_total", deployment="hq", status="429") == 0
    stack.hq.release.set()
    assert (await first)[0] == 200
    async with (
        aiohttp.ClientSession() as http,
        http.get(stack.gateway.make_url("/admin/sessions"), headers=ADMIN) as resp,
    ):
        sessions = (await resp.json())["data"]
    assert [s for s in sessions if "refused" in json.dumps(s)] == []


async def _held_while_streaming(stack: Stack, stream: bool) -> float:
    """What the tenant's day holds while one call to fast is in flight."""
    stack.fast.faults.append(Fault(hold=True))  # the answer waits until released: the hold stays open
    async with aiohttp.ClientSession() as http:
        call = asyncio.ensure_future(http.post(stack.base_url + "/chat/completions", json={
            "model": "fast", "messages": HELLO, "stream": stream, "max_tokens": 100}))

        async def held() -> bool:
            return (await _day(stack))[1] > 0

        await until(held, what="the call's hold")
        reserved = (await _day(stack))[1]
        stack.fast.release.set()
        (await call).close()
    return reserved


@pytest.mark.parametrize("resume", ["true", "false"])
async def test_a_stream_the_sibling_may_finish_holds_its_re_read_too(make_stack: Any, resume: str) -> None:
    """A resumed stream costs the sibling the prompt and the answer so far again, at its input price: the hold
    covers that part too (at most prompt plus cap), and only where a resume may happen."""
    stack: Stack = await make_stack(f"""
        tenants: [{{name: anonymous, budgets: [{{window: day, hard_usd: 10}}]}}]
        resume: {{enabled: {resume}}}
    """)
    plain = await _held_while_streaming(stack, stream=False)
    stack.fast.release.clear()
    streamed = await _held_while_streaming(stack, stream=True)
    if resume == "false":
        assert streamed == pytest.approx(plain)
    else:  # hq's input price (3 USD/Mtok) over hq's prompt ceiling plus its cap of 100
        assert streamed - plain > 100 * 3 / 1e6 and streamed - plain < 400 * 3 / 1e6
