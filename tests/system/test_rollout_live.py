"""Rollouts and shadows in the running gateway: real aiohttp servers, the openai SDK, faulty fakes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import FakeVLLM, Fault
from gateway.cli.command import main
from gateway.server.settings import Settings
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, metric, three_deployments

HELLO = [{"role": "user", "content": "hello there"}]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

ROLLOUT = """
rollouts:
  - id: hq-v2-test
    route: hq
    candidate: deployment:hq-v2
    stable: deployment:hq
    steps:
      - set_weight: 50
      - pause: {duration_s: 600}
"""


class Live:
    """Three fake deployments and a gateway; `hq-v2` is the rollout's candidate."""

    def __init__(self, hq: FakeVLLM, fast: FakeVLLM, v2: FakeVLLM, gateway: TestServer) -> None:
        self.hq, self.fast, self.v2, self.gateway = hq, fast, v2, gateway

    def url(self, path: str) -> str:
        return str(self.gateway.make_url(path))

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key="sk-test", max_retries=0)

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.url(path), json=body, headers=AUTH) as r,
        ):
            return r.status, await r.json(content_type=None)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of `name` whose labels include `labels`."""
        async with aiohttp.ClientSession() as s, s.get(self.url("/metrics")) as r:
            text = await r.text()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line for w in wanted)
        )


@pytest.fixture
async def make_live(
    aiohttp_server: Callable[..., Any], gateway_server: Callable[[Settings], Any], tmp_path: Path
) -> Callable[..., Any]:
    async def make(extra: str, **settings: Any) -> Live:
        hq, fast, v2 = FakeVLLM("fake-hq"), FakeVLLM("fake-fast"), FakeVLLM("fake-hq-v2")
        urls = [await fake_server(f, aiohttp_server) for f in (hq, fast, v2)]
        path = tmp_path / "policy.yaml"
        path.write_text(three_deployments(*urls, extra))
        cfg = Settings(policy=str(path), admin_token=ADMIN_TOKEN, policy_poll_s=0.1, **settings)
        return Live(hq, fast, v2, await gateway_server(cfg))

    return make


async def _aborted(live: Live) -> bool:
    return (await _phase(live))[0] == "Aborted"


async def _phase(live: Live) -> tuple[str, float]:
    _, st = await live.admin("GET", "/admin/rollouts/hq")
    return st["phase"], st["weight_pct"]


async def test_failing_candidate_aborts_and_its_clients_return_to_stable(
    make_live: Callable[..., Any],
) -> None:
    live = await make_live(ROLLOUT)
    await until(lambda: _weight_is(live, 50.0))
    live.v2.fail_after = 10  # the candidate answers its first 10 requests, then only 500s
    served: dict[str, str] = {}
    sent = 0
    async with live.client() as client:
        for i in range(400):  # bounded: the abort must come long before this
            raw = await client.chat.completions.with_raw_response.create(
                model="hq", messages=HELLO, extra_headers={"x-session-id": f"s{i}"}
            )
            served[f"s{i}"] = raw.headers["x-gateway-deployment"]
            sent += 1
            if (await _phase(live))[0] == "Aborted":
                break
        phase, weight = await _phase(live)
        assert (phase, weight) == ("Aborted", 0.0)
        candidate_sessions = [s for s, dep in served.items() if dep == "hq-v2"]
        assert candidate_sessions, "some sessions were served by the candidate before it failed"
        for session in candidate_sessions[:5]:
            raw = await client.chat.completions.with_raw_response.create(
                model="hq", messages=HELLO, extra_headers={"x-session-id": session}
            )
            assert raw.headers["x-gateway-deployment"] == "hq"
    candidate_requests = len(live.v2.received)
    print(
        f"\nrequests until abort: {sent} in all, {candidate_requests} reached the candidate "
        f"({candidate_requests - 10} of them failing)"
    )
    _, history = await live.admin("GET", "/admin/rollouts/hq/history")
    assert history[-1]["action"] == "abort" and "error_rate" in history[-1]["reason"]
    assert sent < 100


async def _weight_is(live: Live, weight: float, route: str = "hq") -> bool:
    status, st = await live.admin("GET", f"/admin/rollouts/{route}")
    return status == 200 and st["weight_pct"] == weight and st["replica"]["weight_pct"] == weight


# Every call on `fast` goes to the candidate hq-v2 (hq's price): at max_tokens 100 its worst case is about
# 1,550 µUSD, fast's about 160.
CANDIDATE_FOR_ALL = """
rollouts:
  - id: fast-to-v2
    route: fast
    candidate: deployment:hq-v2
    stable: deployment:fast
    steps:
      - set_weight: 100
      - pause: {}
"""


@pytest.mark.parametrize(
    ("tenancy", "headers"),
    [
        ("tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 0.001}]}]", {}),
        ("tenants: [{name: anonymous, budgets: [{window: day, soft_usd: 0}], above_soft: {refuse: [hq-v2]}}]",
         {}),
        ("", {"x-gateway-max-cost-usd": "0.0005"}),
    ],
    ids=["hard-limit", "refused-above-soft", "cost-cap-header"],
)
async def test_a_candidate_goes_through_admission_like_any_deployment(
    make_live: Callable[..., Any], tenancy: str, headers: dict[str, str]
) -> None:
    live = await make_live(CANDIDATE_FOR_ALL + tenancy)
    await until(lambda: _weight_is(live, 100.0, "fast"))
    async with live.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="fast", messages=HELLO, max_tokens=100, extra_headers=headers
        )  # before: the candidate's hold (or call) went through anyway, and near a hard limit got 429
        assert raw.headers["x-gateway-deployment"] == "fast"
        assert live.v2.received == []
        assert await _served_by_arm(live) == {"candidate": 0, "stable": 1}  # the arm that served it
        roomy = await client.chat.completions.with_raw_response.create(model="fast", messages=HELLO, max_tokens=1)
    if not tenancy:  # a call whose worst case fits everything still goes to the candidate
        assert roomy.headers["x-gateway-deployment"] == "hq-v2"
        assert await _served_by_arm(live) == {"candidate": 1, "stable": 1}  # as served, not as assigned


async def _served_by_arm(live: Live) -> dict[str, float]:
    return {arm: await metric(live.gateway, "gateway_rollout_requests_total", route="fast", arm=arm)
            for arm in ("candidate", "stable")}


async def test_only_calls_a_deployment_served_are_sampled_shadowed_and_paired(
    make_live: Callable[..., Any],
) -> None:
    from gateway.server.resources import STATE

    shadow = """
shadows:
  - {route: fast, target: "deployment:hq", percent: 100, sample_by: random}
tenants: [{name: anonymous, requests_per_minute: 2}]
"""
    live = await make_live(CANDIDATE_FOR_ALL + shadow)
    await until(lambda: _weight_is(live, 100.0, "fast"))
    live.v2.faults = [Fault(status=400)]
    async with live.client() as client:
        with pytest.raises(openai.BadRequestError):  # the deployment's 400: the request's fault, not a sample
            await client.chat.completions.create(model="fast", messages=HELLO)
        await client.chat.completions.create(model="fast", messages=HELLO)  # served: the one sample
        with pytest.raises(openai.RateLimitError):  # refused at the budget hold: no sample, no shadow
            await client.chat.completions.create(model="fast", messages=HELLO)
    experiments = live.gateway.app[STATE].experiments
    await experiments.rollouts.flush()
    _, status = await live.admin("GET", "/admin/rollouts/fast")
    assert status["samples"]["candidate"] == 1
    assert len(live.hq.received) == 2  # the two calls that reached a deployment were shadowed
    await asyncio.gather(*experiments.shadows._tasks)
    _, pairs = await live.admin("GET", "/admin/shadow/pairs?target=deployment:hq")
    assert [p["primary"]["status"] for p in pairs] == [200]  # a 400 or 429 is no candidate win


STALL_SHADOW = """
shadows:
  - route: auto
    target: deployment:hq
    percent: 100
    sample_by: random
    max_in_flight: 2
    timeout_s: 1.0
    max_tokens: 16
"""


async def test_stalling_shadow_never_delays_the_client(make_live: Callable[..., Any]) -> None:
    live = await make_live(STALL_SHADOW)
    live.hq.faults = [Fault(stall_s=10.0) for _ in range(20)]
    timings: list[float] = []
    async with live.client() as client:
        for _ in range(6):
            started = time.perf_counter()
            await client.chat.completions.create(
                model="auto",
                messages=HELLO,
                max_tokens=100,
                extra_body={"store": True, "metadata": {"a": "b"}},
            )
            timings.append(time.perf_counter() - started)
    assert max(timings) < 0.5, timings  # the shadows stall for 10 s; the client never waits for them
    assert await live.metric("gateway_shadow_dropped_total", reason="in_flight_cap") >= 3
    async def both_timed_out() -> bool:
        return await live.metric("gateway_shadow_requests_total", result="timeout") == 2

    await until(both_timed_out, timeout_s=3.0)
    sent = live.hq.received[0]
    assert sent["max_tokens"] == 16 and "store" not in sent and "metadata" not in sent
    assert live.hq.headers_seen[0].get("x-gateway-shadow") == "1"
    assert "store" in live.fast.received[0]  # the client's own request is passed on untouched


async def test_shadow_pairs_stream_compare_and_report(make_live: Callable[..., Any], capsys: Any) -> None:
    live = await make_live(STALL_SHADOW)
    async with live.client() as client:
        for _ in range(3):
            stream = await client.chat.completions.create(
                model="auto", messages=HELLO, stream=True, temperature=0
            )
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def pairs() -> Any:
        _, found = await live.admin("GET", "/admin/shadow/pairs?target=deployment:hq")
        return found if len(found) == 3 else None

    records = await until(pairs)
    assert all(live.hq.received[i]["stream"] for i in range(3))  # the shadow streams like the client did
    assert all(
        r["stream"] and r["shadow"]["ttft_ms"] is not None and r["exact_match"] is True for r in records
    )
    code = await asyncio.to_thread(
        main,
        [
            "shadow",
            "report",
            "--url",
            live.url(""),
            "--admin-token",
            ADMIN_TOKEN,
            "--target",
            "deployment:hq",
        ],
    )
    assert code == 0 and "shadow pairs: 3" in capsys.readouterr().out


async def test_rollout_cli_against_the_admin_api(make_live: Callable[..., Any], capsys: Any) -> None:
    live = await make_live(ROLLOUT)
    await until(lambda: _weight_is(live, 50.0))
    base = ["--url", live.url(""), "--admin-token", ADMIN_TOKEN]

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = await asyncio.to_thread(cli, "rollout", "status", "hq", *base)
    assert code == 0 and "Progressing" in out and "error_rate" in out
    code, out, _ = await asyncio.to_thread(
        cli, "rollout", "pause", "hq", "--reason", "look", "--actor", "ann", *base
    )
    assert code == 0 and "Paused" in out
    code, _, err = await asyncio.to_thread(cli, "rollout", "resume", "hq", "--generation", "1", *base)
    assert code == 2 and "HTTP 409" in err and "stale" in err
    code, out, _ = await asyncio.to_thread(cli, "rollout", "abort", "hq", "--reason", "enough", *base)
    assert code == 0 and "Aborted" in out
    code, out, _ = await asyncio.to_thread(cli, "rollout", "history", "hq", *base)
    assert code == 0 and "by ann: look" in out and "abort" in out
    status, body = await live.admin("POST", "/admin/rollouts/hq/resume", {"actor": "x", "generation": 0})
    assert status == 409 and body["error"]["code"] == "stale_generation"
    await until(lambda: _weight_is(live, 0.0))


POLICY_SHADOW = """
policies:
  tools-to-fast:
    rules:
      - name: long-to-hq
        when: {prompt_tokens: {gte: 2000}}
        use: hq
policy_shadow: {candidate: tools-to-fast, percent: 100}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_policy_shadow_and_request_log_then_simulate(
    make_live: Callable[..., Any], tmp_path: Path, capsys: Any
) -> None:
    log_path = tmp_path / "requests.jsonl"
    live = await make_live(POLICY_SHADOW, request_log=str(log_path))
    async with live.client() as client:
        for i in range(6):
            await client.chat.completions.create(model="auto", messages=HELLO, tools=TOOLS if i % 2 else None)
    _, found = await live.admin("GET", "/admin/shadow/policy")
    assert found["decisions"] == {"agree": 3, "disagree": 3}
    assert {d["live"]["deployment"] for d in found["disagreements"]} == {"hq"}
    assert {d["decision"]["deployment"] for d in found["disagreements"]} == {"fast"}
    assert len(live.hq.received) == 3  # the candidate policy called nothing
    await until(
        lambda: asyncio.sleep(0, result=log_path.exists() and len(log_path.read_text().splitlines()) == 6)
    )
    record = json.loads(log_path.read_text().splitlines()[0])
    assert "last_user_text" not in record["features"] and "body" not in record  # prompts redacted
    assert record["usage"]["completion_tokens"] == 8 and record["cost_usd"] > 0
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text(Path(live_policy_path(tmp_path)).read_text().replace("use: hq\n", "use: fast\n", 1))
    code = main(["policy", "simulate", "--log", str(log_path), "--policy", str(candidate)])
    out = capsys.readouterr().out
    assert code == 0
    assert "requests replayed: 6" in out and "decisions changed: 3 of 6" in out
    assert "hq (tools-to-hq) -> fast (tools-to-hq)" in out


def live_policy_path(tmp_path: Path) -> str:
    return str(tmp_path / "policy.yaml")


AGENT_ROLLOUT = ROLLOUT + """    guards:
      rework_rate: {margin: 0.1}
"""


async def test_a_candidate_that_makes_agents_loop_more_is_aborted(make_live: Callable[..., Any]) -> None:
    from tests.fixtures.agent_runs import Agent

    live = await make_live(AGENT_ROLLOUT)
    await until(lambda: _weight_is(live, 50.0))
    live.hq.tool_args = lambda n: {"query": "launch code", "page": n}  # stable moves on every step
    # the candidate's fake asks for the same call every time: its agents redo their work
    served: list[str] = []
    async with live.client() as client:
        for i in range(60):  # bounded: the abort must come long before this
            agent = await Agent(client, f"agent-{i}", model="hq").run(4)
            served += agent.served
            if (await _phase(live))[0] == "Aborted":
                break
    # The leader rules at its next tick on the samples flushed so far: the traffic may end before it does.
    await until(lambda: _aborted(live), what="the rollout aborted")
    _, history = await live.admin("GET", "/admin/rollouts/hq/history")
    assert history[-1]["action"] == "abort" and history[-1]["reason"].startswith("rework_rate:")
    assert "hq-v2" in served and "hq" in served
    print(f"\nagent steps until abort: {len(served)}, {served.count('hq-v2')} of them on the candidate")
    status, st = await live.admin("GET", "/admin/rollouts/hq")
    assert status == 200
    rework = next(m for m in st["metrics"] if m["metric"] == "rework_rate")
    assert rework["status"] == "fail" and rework["estimate"] > 0.5
