"""GET /admin/deployments: health and load per deployment, live shares, and the targets they answer to."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from tests.fixtures.stack import ADMIN_TOKEN, OpsStack

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
HELLO = [{"role": "user", "content": "hi"}]


async def _get(stack: OpsStack, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(stack.url(path), headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _rollout_at(stack: OpsStack, weight_pct: float) -> None:
    deadline = time.monotonic() + 20
    while (await _get(stack, "/admin/rollouts/hq"))["weight_pct"] != weight_pct:
        assert time.monotonic() < deadline, "the rollout did not reach its weight"
        await asyncio.sleep(0.1)


async def test_deployments_show_health_load_shares_and_targets(ops_stack: OpsStack) -> None:
    await _rollout_at(ops_stack, 50)
    first = await _get(ops_stack, "/admin/deployments")
    assert first["shares"]["requests"] == 0 and first["shares"]["deployments"] == {}
    async with ops_stack.client() as client:
        for i in range(12):
            await client.chat.completions.create(model="hq", messages=HELLO, extra_headers={"x-session-id": f"s{i}"})
        for _ in range(8):
            await client.chat.completions.create(model="auto", messages=HELLO)
    view = await _get(ops_stack, "/admin/deployments")
    by_name = {d["name"]: d for d in view["deployments"]}
    assert set(by_name) == {"hq", "fast", "hq-v2"}
    assert by_name["fast"]["healthy"] is True and by_name["fast"]["kv_cache_usage"] == 0.1
    assert by_name["hq"]["max_in_flight"] == 256 and by_name["hq"]["in_flight"] == 0
    assert view["worker"] == {"index": 0, "of": 1, "pid": view["worker"]["pid"], "prober": 0}
    shares = view["shares"]
    assert shares["requests"] == 20 and shares["window_s"] > 0
    assert abs(sum(shares["deployments"].values()) - 1) < 1e-9
    assert shares["deployments"]["hq"] + shares["deployments"]["hq-v2"] == 12 / 20  # the pinned route, both arms
    targets = {t["kind"]: t for t in view["targets"]}
    share = targets["hq_share"]
    assert (share["route"], share["rules"], share["target"]) == ("auto", ["hard-prompt-to-hq"], 0.3)
    assert share["observed"] is not None and share["threshold"] is not None
    rollout = targets["rollout"]
    assert rollout["route"] == "hq" and rollout["target"] == 0.5
    assert rollout["phase"] == "Paused"  # the manual pause after set_weight
    assert 0 < rollout["observed"] < 1


async def test_usage_shows_each_tenants_limits(ops_stack: OpsStack) -> None:
    async with ops_stack.client() as client:
        await client.chat.completions.create(model="fast", messages=HELLO)
    usage = await _get(ops_stack, "/admin/usage")
    assert {row["tenant"] for row in usage["data"]} == {"anonymous"}
    assert usage["limits"] == {"anonymous": [{"window": "day", "soft_usd": 1.0, "hard_usd": 2.0}]}
