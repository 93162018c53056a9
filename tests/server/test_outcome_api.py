"""POST /v1/sessions/{id}/outcome and GET /admin/outcomes on a running gateway: real aiohttp servers, fake
deployments, agents driven by the openai SDK; the tenant from the API key; several replicas on one Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest

from gateway.accounting import keys
from gateway.server.resources import STATE
from tests.fixtures.agent_runs import Agent, admin, recorded
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.stack import Stack, metric


def _base(stack: Stack) -> str:
    return str(stack.gateway.make_url("")).rstrip("/")


async def report(stack: Stack, session: str, body: Any, api_key: str = "sk-client-secret") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
        f"{_base(stack)}/v1/sessions/{session}/outcome", json=body, headers={"authorization": f"Bearer {api_key}"}
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_an_agent_reports_its_outcome_and_a_second_report_replaces_it(stack: Stack) -> None:
    async with stack.client() as client:
        await Agent(client, "run-1").run(3)
    session = await recorded(_base(stack), "run-1", 3)
    status, body = await report(stack, "run-1", {"success": True, "score": 0.8, "labels": {"task": "t1"}})
    assert status == 200 and body["object"] == "session.outcome" and body["session_id"] == "run-1"
    assert body["outcome"]["success"] is True and body["outcome"]["steps"] == 3 and body["replaced"] is False
    assert body["outcome"]["cost_usd"] == pytest.approx(session["cost_usd"])
    labels = {"route": "auto", "mix": "hq", "arm": "none", "outcome": "success"}
    assert await metric(stack.gateway, "gateway_agent_session_outcomes_total", **labels) == 1
    assert await metric(stack.gateway, "gateway_agent_session_outcome_cost_usd_total", **labels) == pytest.approx(
        session["cost_usd"])
    assert await metric(stack.gateway, "gateway_agent_session_outcome_steps_total", **labels) == 3

    status, body = await report(stack, "run-1", {"success": False, "reason": "the tests failed after all"})
    assert status == 200 and body["replaced"] is True
    assert [o["success"] for o in body["outcome_history"]] == [True]  # the replaced report, kept
    _, shown = await admin(_base(stack), "/admin/sessions/run-1")
    assert shown["outcome"]["success"] is False and shown["outcome"]["reason"] == "the tests failed after all"
    assert shown["outcome_history"][0]["labels"] == {"task": "t1"}
    assert await metric(stack.gateway, "gateway_agent_session_outcomes_total") == 1  # counted at the first report
    assert await metric(stack.gateway, "gateway_agent_session_outcomes_replaced_total", previous="success",
                        outcome="failure") == 1
    _, figures = await admin(_base(stack), "/admin/outcomes")
    row = figures["data"][0]
    assert (row["route"], row["mix"], row["arm"], row["sessions"], row["successes"]) == ("auto", "hq", "none", 1, 0)
    assert row["success_rate"] == 0 and row["cost_per_success_usd"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"success": "yes"}, "success"), ({"success": True, "score": 2}, "score"), ({"ok": True}, "ok"),
])
async def test_a_bad_report_is_a_400_in_the_openai_envelope(stack: Stack, body: Any, param: str) -> None:
    async with stack.client() as client:
        await Agent(client, "run-2").run(1)
    await recorded(_base(stack), "run-2", 1)
    status, answer = await report(stack, "run-2", body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    _, shown = await admin(_base(stack), "/admin/sessions/run-2")
    assert shown["outcome"] is None


async def test_an_unknown_session_or_a_body_that_is_not_json_writes_nothing(stack: Stack) -> None:
    status, answer = await report(stack, "never-ran", {"success": True})
    assert status == 404 and answer["error"]["code"] == "session_not_found"
    async with aiohttp.ClientSession() as http, http.post(f"{_base(stack)}/v1/sessions/x/outcome",
                                                          data=b"{not json") as resp:
        assert resp.status == 400 and "error" in await resp.json()
    status, listed = await admin(_base(stack), "/admin/sessions")
    assert listed["data"] == []


async def test_a_tenant_reports_only_its_own_sessions(make_stack: Callable[..., Any]) -> None:
    stack: Stack = await make_stack("auth: {enabled: true}\n")
    store = stack.gateway.app[STATE].accounting.store
    _, acme = await keys.create(store, "acme")
    _, other = await keys.create(store, "other")
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key=acme, max_retries=0) as client:
        await Agent(client, "run-3").run(2)
    await recorded(_base(stack), "run-3", 2)
    status, answer = await report(stack, "run-3", {"success": True}, api_key=other)
    assert status == 404 and answer["error"]["code"] == "session_not_found"  # never a hint it exists
    status, answer = await report(stack, "run-3", {"success": True}, api_key="agk-00000000-wrong")
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    _, shown = await admin(_base(stack), "/admin/sessions/run-3")
    assert shown["outcome"] is None and shown["tenant"] == "acme"
    status, _ = await report(stack, "run-3", {"success": True}, api_key=acme)
    assert status == 200


async def test_any_replica_takes_the_report_of_a_session_another_recorded(
    make_stack: Callable[..., Any], private_redis: RedisServer
) -> None:
    settings = {"redis_url": private_redis.url}
    first: Stack = await make_stack(settings=settings)
    second: Stack = await make_stack(settings=settings)
    async with first.client() as client:
        await Agent(client, "run-4").run(2)
    await recorded(_base(first), "run-4", 2)
    status, body = await report(second, "run-4", {"success": True, "reason": "merged"})
    assert status == 200 and body["outcome"]["steps"] == 2
    _, shown = await admin(_base(first), "/admin/sessions/run-4")
    assert shown["outcome"]["reason"] == "merged"


async def test_a_report_right_after_the_last_step_finds_the_step_not_yet_flushed(stack: Stack) -> None:
    async with stack.client() as client:
        await Agent(client, "run-5").run(2)
    status, body = await report(stack, "run-5", {"success": True})  # no wait for the recorder's flush
    assert status == 200 and body["outcome"]["steps"] == 2


async def test_the_report_counts_the_last_step_even_before_the_recorder_wrote_it(stack: Stack) -> None:
    from gateway.server.resources import STATE

    trajectories = stack.gateway.app[STATE].trajectories
    async with stack.client() as client:
        agent = await Agent(client, "run-6").run(1)
        await recorded(_base(stack), "run-6", 1)  # the session exists, with its first step
        assert trajectories._task is not None
        trajectories._task.cancel()  # the background flusher stops: the next step stays queued
        await agent.step()
    assert len(trajectories._queue) == 1
    status, body = await report(stack, "run-6", {"success": True})
    assert status == 200 and body["outcome"]["steps"] == 2  # the queued step counted too
    assert body["outcome"]["cost_usd"] == pytest.approx(2 * (11 * 3 + 8 * 15) / 1e6)
