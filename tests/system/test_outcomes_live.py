"""Rollouts judged by task outcomes in the running gateway: agents driven by the openai SDK through real
aiohttp servers against scripted fake deployments, each run judging its own result and reporting it
through the outcome API; the leader's ticks rule on task_success_rate and cost_per_success."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import FakeVLLM
from gateway.server.settings import Settings
from tests.fixtures.agent_runs import Agent
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, metric, three_deployments

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
RIGHT, WRONG = {"query": "launch code"}, {"query": "lunch menu"}


def rollout(candidate: str, guards: str) -> str:
    return f"""
rollouts:
  - id: outcomes-live
    route: hq
    candidate: deployment:{candidate}
    stable: deployment:hq
    steps:
      - set_weight: 50
      - pause: {{duration_s: 2}}
      - set_weight: 100
    guards:
{guards}
"""


class Live:
    def __init__(self, hq: FakeVLLM, fast: FakeVLLM, v2: FakeVLLM, gateway: TestServer) -> None:
        self.hq, self.fast, self.v2, self.gateway = hq, fast, v2, gateway
        self.base = str(gateway.make_url("")).rstrip("/")

    async def admin(self, path: str) -> Any:
        async with aiohttp.ClientSession() as http, http.get(self.base + path, headers=AUTH) as resp:
            return await resp.json()

    async def state(self) -> tuple[str, float]:
        found = await self.admin("/admin/rollouts/hq")
        return found["phase"], found["weight_pct"]


@pytest.fixture
async def make_live(aiohttp_server: Callable[..., Any], gateway_server: Callable[[Settings], Any],
                    tmp_path: Path) -> Callable[[str], Any]:
    async def make(extra: str) -> Live:
        hq, fast, v2 = FakeVLLM("fake-hq"), FakeVLLM("fake-fast"), FakeVLLM("fake-hq-v2")
        urls = [await fake_server(f, aiohttp_server) for f in (hq, fast, v2)]
        path = tmp_path / "policy.yaml"
        path.write_text(three_deployments(*urls, extra))
        gateway = await gateway_server(Settings(policy=str(path), admin_token=ADMIN_TOKEN, policy_poll_s=0.1))
        return Live(hq, fast, v2, gateway)

    return make


async def run_and_report(client: openai.AsyncOpenAI, live: Live, session: str) -> tuple[str, bool]:
    """One agent run of 3 steps; it succeeded when its last search asked for the launch code (its own check
    of its answer), and says so through the outcome API. Returns the deployment it ran on and the outcome."""
    agent = await Agent(client, session, model="hq").run(3)
    last = agent.messages[-2]["tool_calls"][0]["function"]["arguments"]
    success = json.loads(last) == RIGHT
    async with aiohttp.ClientSession() as http, http.post(
        f"{live.base}/v1/sessions/{session}/outcome", json={"success": success, "labels": {"task": "launch"}}
    ) as resp:
        assert resp.status == 200, await resp.text()
    return agent.served[-1], success


async def test_a_candidate_whose_agents_succeed_less_often_is_aborted(make_live: Callable[[str], Any]) -> None:
    live: Live = await make_live(rollout("hq-v2", "      task_success_rate: {margin: 0.05, min_sessions: 10}"))
    await until(lambda: _at(live, "Progressing", 50.0), what="the rollout at 50%")
    live.hq.tool_args = lambda n: RIGHT
    live.v2.tool_args = lambda n: RIGHT if n % 3 == 0 else WRONG  # the candidate's runs end wrong two in three
    runs: list[tuple[str, bool]] = []
    async with openai.AsyncOpenAI(base_url=live.base + "/v1", api_key="unused", max_retries=0) as client:
        for i in range(0, 200, 8):  # bounded: the abort must come long before this
            runs += await asyncio.gather(*(run_and_report(client, live, f"a{j}") for j in range(i, i + 8)))
            if (await live.state())[0] == "Aborted":
                break
    await until(lambda: _at(live, "Aborted", 0.0), timeout_s=60, what="the rollout aborted")
    history = await live.admin("/admin/rollouts/hq/history")
    assert history[-1]["action"] == "abort" and history[-1]["reason"].startswith("task_success_rate:")
    on_candidate = [ok for dep, ok in runs if dep == "hq-v2"]
    on_stable = [ok for dep, ok in runs if dep == "hq"]
    assert on_candidate and on_stable and all(on_stable) and not all(on_candidate)
    print(f"\nagent runs until abort: {len(runs)}; candidate {sum(on_candidate)}/{len(on_candidate)} succeeded, "
          f"stable {sum(on_stable)}/{len(on_stable)}")


async def test_a_candidate_cheaper_per_solved_task_is_promoted(make_live: Callable[[str], Any]) -> None:
    guards = ("      task_success_rate: {margin: 0.2, min_sessions: 12}\n"
              "      cost_per_success: {max_ratio: 1.1, min_sessions: 12}")
    live: Live = await make_live(rollout("fast", guards))  # fast: a ninth of hq's price, the same answers
    await until(lambda: _at(live, "Progressing", 50.0), what="the rollout at 50%")
    live.hq.tool_args = live.fast.tool_args = lambda n: RIGHT
    runs: list[tuple[str, bool]] = []
    async with openai.AsyncOpenAI(base_url=live.base + "/v1", api_key="unused", max_retries=0) as client:
        for i in range(0, 200, 8):
            runs += await asyncio.gather(*(run_and_report(client, live, f"b{j}") for j in range(i, i + 8)))
            if (await live.state())[0] != "Progressing" or (await live.state())[1] == 100.0:
                break
    await until(lambda: _at(live, "Healthy", 100.0), timeout_s=60, what="the rollout promoted")
    history = await live.admin("/admin/rollouts/hq/history")
    assert [h["action"] for h in history][-2:] == ["promote", "promoted"]
    assert any(h["action"] == "step passed" for h in history)
    served = {dep for dep, _ in runs}
    assert served == {"fast", "hq"} and all(ok for _, ok in runs)
    cohorts = {arm: await metric(live.gateway, "gateway_agent_session_outcomes_total", route="hq", arm=arm,
                                 outcome="success") for arm in ("candidate", "control")}
    assert cohorts["candidate"] >= 12 and cohorts["control"] >= 12
    per_success = {arm: await metric(live.gateway, "gateway_agent_session_outcome_cost_usd_total", route="hq",
                                     arm=arm) / cohorts[arm] for arm in cohorts}
    assert per_success["candidate"] < per_success["control"] / 5  # cheaper per solved task, by its price
    print(f"\nagent runs until promoted: {len(runs)}, {sum(1 for d, _ in runs if d == 'fast')} on the candidate")


async def _at(live: Live, phase: str, weight: float) -> bool:
    return await live.state() == (phase, weight)
