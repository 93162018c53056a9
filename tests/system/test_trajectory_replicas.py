"""Two gateway replicas on one Redis: a session's steps through either make one trajectory, a loop one of them
detects stops the session on the other, and a replica that loses Redis keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import FakeVLLM
from gateway.server.app import create_app
from gateway.server.settings import Settings
from tests.fixtures.agent_runs import Agent, admin, recorded
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, policy_yaml

pytestmark = pytest.mark.redis

STOP_LOOPS = """
agents:
  loops:
    action: stop
    repeated_tool_call: {count: 4, window_steps: 6}
"""


async def _replicas(aiohttp_server: Callable[..., Any], tmp_path: Path, redis: RedisServer) -> list[TestServer]:
    hq, fast = FakeVLLM("fake-hq"), FakeVLLM("fake-fast")
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml(await fake_server(hq, aiohttp_server), await fake_server(fast, aiohttp_server),
                                STOP_LOOPS))
    settings = Settings(policy=str(path), admin_token=ADMIN_TOKEN, redis_url=redis.url, policy_poll_s=0.1)
    return [await aiohttp_server(create_app(settings)) for _ in range(2)]


def _client(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-test", max_retries=0)


def _base(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_a_session_across_replicas_is_one_trajectory_and_a_loop_stops_it_everywhere(
    aiohttp_server: Callable[..., Any], tmp_path: Path, private_redis: RedisServer
) -> None:
    a, b = await _replicas(aiohttp_server, tmp_path, private_redis)
    async with _client(a) as via_a, _client(b) as via_b:
        agent = Agent(via_a, "shared")
        for i in range(3):  # alternate replicas, the same session, the same call each time
            agent.client = via_a if i % 2 == 0 else via_b
            await agent.step()
        seen_by_b = await recorded(_base(b), "shared", 3)
        assert [s["step"] for s in seen_by_b["steps"]] == [1, 2, 3] and seen_by_b["step_count"] == 3
        agent.client = via_a
        await agent.step()  # the fourth repeat: flagged by a's flusher
        await recorded(_base(a), "shared", 4)
        agent.client = via_b
        with pytest.raises(openai.RateLimitError) as refused:
            await agent.step()  # b reads the session's flags from Redis before deciding
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "agent_loop_detected"
    status, listed = await admin(_base(b), "/admin/sessions")
    assert status == 200 and listed["data"][0]["flags"] == ["loop:repeated_tool_call"]


async def test_without_redis_a_replica_serves_and_drops_the_steps(
    aiohttp_server: Callable[..., Any], tmp_path: Path, private_redis: RedisServer
) -> None:
    a, _ = await _replicas(aiohttp_server, tmp_path, private_redis)
    private_redis.kill()
    async with _client(a) as client:
        agent = await Agent(client, "offline").run(5)  # stop rules read Redis first: it fails open
    assert agent.served == ["hq"] * 5
    status, body = await admin(_base(a), "/admin/sessions")
    assert status == 503 and body["error"]["code"] == "store_unavailable"
