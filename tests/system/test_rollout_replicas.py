"""Three gateway processes on one Redis: an abort on one is applied by all; losing Redis fails safe to stable."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fakes.faulty_vllm import FakeVLLM
from gateway.rollout.step import bucket
from tests.fixtures.processes import spawn_gateway, stop
from tests.fixtures.redis_server import RedisServer, free_port
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, three_deployments

pytestmark = pytest.mark.redis

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ROLLOUT_ID = "hq-v2-replicas"
ROLLOUT = f"""
rollouts:
  - id: {ROLLOUT_ID}
    route: hq
    candidate: deployment:hq-v2
    stable: deployment:hq
    steps:
      - shadow: {{percent: 100}}
      - set_weight: 50
      - pause: {{}}
"""


class Replica:
    def __init__(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.port, self.proc = port, proc
        self.base = f"http://127.0.0.1:{port}"

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, dict[str, str]]:
        async with aiohttp.ClientSession() as s, s.request(method, self.base + path, **kwargs) as r:
            body = await r.json(content_type=None) if "json" in r.content_type else await r.text()
            return r.status, body, dict(r.headers)

    async def applied(self) -> dict[str, Any]:
        status, body, _ = await self.call("GET", "/admin/rollouts/hq", headers=AUTH)
        assert status == 200, body
        return dict(body["replica"])

    async def chat(self, session: str) -> str:
        body = {"model": "hq", "messages": [{"role": "user", "content": "hi"}]}
        status, _, headers = await self.call("POST", "/v1/chat/completions", json=body,
                                             headers={"x-session-id": session})
        assert status == 200
        return headers["x-gateway-deployment"]

    async def metric(self, name: str, **labels: str) -> float:
        _, text, _ = await self.call("GET", "/metrics")
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and all(w in line for w in wanted))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[Path, str], list[Replica]]]:
    started: list[subprocess.Popen[bytes]] = []

    def run(policy: Path, redis_url: str) -> list[Replica]:
        env = {**os.environ, "AGENT_GATEWAY_REDIS_URL": redis_url, "AGENT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
               "AGENT_GATEWAY_LOG_LEVEL": "WARNING", "AGENT_GATEWAY_POLICY_POLL_S": "60"}
        replicas = []
        for i in range(3):
            port = free_port()
            with (tmp_path / f"replica{i}.log").open("wb") as log:
                proc = spawn_gateway(policy, port, env, log=log)
            started.append(proc)
            replicas.append(Replica(port, proc))
        return replicas

    yield run
    stop(started)


async def _until(check: Callable[[], Any], timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if await check():
                return time.monotonic() - started
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met in {timeout_s} s")


@pytest.fixture
async def fakes(aiohttp_server: Callable[..., Any]) -> AsyncIterator[tuple[list[FakeVLLM], list[str]]]:
    found = [FakeVLLM("fake-hq"), FakeVLLM("fake-fast"), FakeVLLM("fake-hq-v2")]
    yield found, [await fake_server(f, aiohttp_server) for f in found]


def _sessions(arm_candidate: bool, n: int) -> list[str]:
    """Session ids whose bucket lands in the candidate's [0, 50) (or in the stable side)."""
    found = []
    for i in range(1000):
        inside = bucket(ROLLOUT_ID, f"header:x-session-id=s{i}") * 100 < 50
        if inside == arm_candidate:
            found.append(f"s{i}")
        if len(found) == n:
            break
    return found


async def test_three_replicas_agree_on_abort_and_fail_safe_without_redis(
    spawn: Callable[[Path, str], list[Replica]], fakes: Any, private_redis: RedisServer,
    tmp_path: Path,
) -> None:
    (hq, _fast, v2), urls = fakes
    policy = tmp_path / "policy.yaml"
    policy.write_text(three_deployments(*urls, ROLLOUT))
    replicas = spawn(policy, private_redis.url)

    async def all_at(phase: str, weight: float) -> bool:
        views = [await r.applied() for r in replicas]
        return all(v["phase"] == phase and v["weight_pct"] == weight and v["fresh"] for v in views)

    await _until(lambda: all_at("Paused", 50.0), 60.0)
    leaders = [(await r.applied())["leading"] for r in replicas]
    assert leaders.count(True) == 1, leaders

    # An abort through one replica's admin API is applied by the other two within 2 s.
    _, st, _ = await replicas[0].call("GET", "/admin/rollouts/hq", headers=AUTH)
    body = {"actor": "test", "reason": "drill", "generation": st["generation"]}
    status, _, _ = await replicas[0].call("POST", "/admin/rollouts/hq/abort", json=body, headers=AUTH)
    assert status == 200
    took = [await _until(lambda r=r: _phase_is(r, "Aborted"), 2.0) for r in replicas[1:]]
    print(f"\nabort applied by the other replicas after {max(took):.3f} s")
    (candidate,) = _sessions(True, 1)
    assert {await r.chat(candidate) for r in replicas} == {"hq"}

    # Retry: back to weight 50 with shadows on; the candidate-arm session is served by hq-v2 everywhere.
    _, st, _ = await replicas[1].call("GET", "/admin/rollouts/hq", headers=AUTH)
    body = {"actor": "test", "reason": "again", "generation": st["generation"]}
    assert (await replicas[1].call("POST", "/admin/rollouts/hq/retry", json=body, headers=AUTH))[0] == 200
    await _until(lambda: all_at("Paused", 50.0), 10.0)
    fresh_session = _sessions(True, 2)[1]
    assert {await r.chat(fresh_session) for r in replicas} == {"hq-v2"}
    (stable_session,) = _sessions(False, 1)
    await replicas[0].chat(stable_session)
    await _until(lambda: asyncio.sleep(0, result=any(h.get("x-gateway-shadow") for h in v2.headers_seen)), 5.0)

    # Redis dies: every replica serves stable and stops shadows once its state is stale.
    private_redis.kill()

    async def all_stale() -> bool:
        return all([await r.metric("gateway_rollout_state_stale") == 1 for r in replicas])

    await _until(all_stale, 10.0)
    seen_by_v2 = len(v2.received)
    for r in replicas:
        assert await r.chat(fresh_session) == "hq"
        assert await r.chat(stable_session) == "hq"
        assert await r.metric("gateway_rollout_state_stale") == 1
        assert await r.metric("gateway_shadow_dropped_total", reason="stale_state") >= 1
    await asyncio.sleep(0.3)  # a negative check: a shadow still in flight would land within this window
    assert len(v2.received) == seen_by_v2  # neither candidate traffic nor shadows reach it any more
    assert hq.received


async def _phase_is(replica: Replica, phase: str) -> bool:
    return (await replica.applied())["phase"] == phase
