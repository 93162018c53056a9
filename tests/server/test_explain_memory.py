"""The explain memory (the last N live decisions) costs what a decision reads, not what a request carried."""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.server.resources import STATE
from tests.fixtures.stack import ADMIN_TOKEN, Stack

HELLO = [{"role": "user", "content": "hello there"}]


async def test_a_remembered_decision_keeps_only_the_headers_the_policy_reads(stack: Stack) -> None:
    padding = {f"x-pad-{i}": "v" * 8000 for i in range(20)}  # 160 KB of headers the policy never reads
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, extra_headers={"x-priority": "high", **padding})
    request_id = raw.headers["x-request-id"]
    remembered = stack.gateway.app[STATE].recent.get(request_id)
    assert remembered is not None
    assert dict(remembered.ctx.headers) == {"x-priority": "high"}
    # The trail recomputed from what was kept is the one the live request got.
    explained = await _explain(stack, request_id)
    assert explained["deployment"] == "hq" and explained["rule"] == "priority-header"
    assert explained["served"]["rule"] == raw.headers["x-gateway-rule"] == "priority-header"


async def _explain(stack: Stack, request_id: str) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def test_consecutive_decisions_share_the_snapshots_they_read_alike(stack: Stack) -> None:
    ids = []
    async with stack.client() as client:
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model="auto", messages=HELLO, extra_headers={"x-priority": "high"})
            ids.append(raw.headers["x-request-id"])
    recent = stack.gateway.app[STATE].recent
    first, second = recent.get(ids[0]), recent.get(ids[1])
    assert first is not None and second is not None
    # one copy of what two decisions read alike: the policy's headers, the failover order, the trail
    assert second.ctx.headers is first.ctx.headers and dict(second.ctx.headers) == {"x-priority": "high"}
    assert second.served.attempts is first.served.attempts and second.served.reasons is first.served.reasons
    assert second.ctx.share_thresholds is first.ctx.share_thresholds
