"""Reliability rows about agents' calls: hostile agent bodies, and clients that cut a call during its hold.

    agent bad input: bodies an agent (or anyone) can send on the agent path, with a session id on the
        default policy: every answer must be 2xx/4xx, never 5xx, and the gateway must still serve after.
    cut holds: clients that cancel at random points while their budget hold is open (a hard limit policy,
        Redis): once they are gone, the tenant's held concurrency and spend in the store are back to zero.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.proxy_bench import free_port, wait_ready
from bench.rig import HELLO, POLICY, ROOT, Gateway, Rig, Row, settled

ADMIN_TOKEN = "bench-admin-token"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
DEPTH = 5_000
TOOL_MESSAGES = 100_000
NESTED = "<nested>"


def _call(arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": arguments}}


def _agent_body(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"model": "auto", "tools": TOOLS, "messages": [{"role": "user", "content": "fix the bug"}, *turns]}


def bad_bodies() -> dict[str, bytes]:
    """Each hostile body, encoded, by its name in the row."""
    result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    deep = "[" * DEPTH + "]" * DEPTH
    bodies = {
        f"{TOOL_MESSAGES:,} tool messages": _agent_body(
            {"role": "assistant", "content": None, "tool_calls": [_call("{}")]}, *([result] * TOOL_MESSAGES)),
        "tool_calls: 5": _agent_body({"role": "assistant", "content": None, "tool_calls": 5}, result),
        f"arguments nested {DEPTH:,} deep (a string)": _agent_body(
            {"role": "assistant", "content": None, "tool_calls": [_call(deep)]}, result),
        f"arguments nested {DEPTH:,} deep (an object, not a string)": _agent_body(
            {"role": "assistant", "content": None, "tool_calls": [_call(NESTED)]}, result),
    }
    # json.dumps itself recurses: the nested object goes in as text.
    nested = ('{"a": ' * DEPTH + "1" + "}" * DEPTH).encode()
    return {name: json.dumps(body).encode().replace(f'"{NESTED}"'.encode(), nested) for name, body in bodies.items()}


def default_policy(fast: int, hq: int) -> str:
    """policies/default.yaml in front of the fake deployments."""
    text = (ROOT / "policies" / "default.yaml").read_text()
    return text.replace("127.0.0.1:8001", f"127.0.0.1:{hq}").replace("127.0.0.1:8002", f"127.0.0.1:{fast}")


async def _post(http: aiohttp.ClientSession, url: str, raw: bytes, headers: dict[str, str]) -> int:
    async with http.post(url, data=raw, headers={"content-type": "application/json", **headers}) as resp:
        await resp.read()
        return resp.status


async def agent_bad_input(rig: Rig, ports: tuple[int, int], repeat: int) -> Row:
    gw = rig.gateway("agents", default_policy(*ports), {"AGENT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN})
    statuses: dict[str, list[int]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for name, raw in bad_bodies().items():
            for i in range(repeat):
                headers = {"x-session-id": f"bad-{i}"}
                statuses.setdefault(name, []).append(await _post(http, gw.url + "/v1/chat/completions", raw, headers))
            auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            statuses[name].append(await _post(http, gw.url + "/admin/explain", raw, auth))
        up = await _post(http, gw.url + "/v1/chat/completions",
                         json.dumps({"model": "auto", "messages": HELLO}).encode(), {}) == 200
    rig.stop([gw.pid])
    tracebacks = gw.log.read_text(errors="replace").count("Traceback")
    failed = {name: [s for s in got if s >= 500] for name, got in statuses.items()}
    observed = "; ".join(f"{name}: {', '.join(map(str, sorted(set(got))))}" for name, got in statuses.items())
    return Row(f"agent bad input (each {repeat}x to chat, 1x to /admin/explain)",
               sum(map(len, statuses.values())), "2xx/4xx, never 5xx; the gateway serves after",
               f"{observed}; up after: {up}; {tracebacks} tracebacks",
               up and not any(failed.values()))


def _cut_policy(fast: int, hq: int, redis_port: int) -> str:
    price = "    price: {input_per_mtok_usd: 3.0, output_per_mtok_usd: 15.0}\n"
    priced = POLICY.format(fast=fast, hq=hq).replace("served_model: bench\n", "served_model: bench\n" + price)
    return priced + (
        f'store: {{redis_url: "redis://127.0.0.1:{redis_port}/0", on_unavailable: reject}}\n'
        'tenants:\n  - name: "*"\n    max_concurrent: 256\n    budgets: [{window: day, hard_usd: 1000}]\n')


async def _cut(http: aiohttp.ClientSession, gw: Gateway, after_s: float) -> None:
    """A streamed call (64 chunks, 10 ms apart) that its client abandons after `after_s`."""
    async def call() -> None:
        async with http.post(gw.url + "/v1/chat/completions", headers={"x-fake-fault": "slow"},
                             json={"model": "auto", "messages": HELLO, "stream": True}) as resp:
            await resp.read()

    task = asyncio.get_running_loop().create_task(call())
    await asyncio.wait([task], timeout=after_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def held(store: aioredis.Redis, tenant: str = "anonymous") -> tuple[int, int, int]:
    """The tenant's open reservations, and the spend (nano-USD) and tokens they hold in its buckets."""
    open_holds = int(await store.zcard(f"ag:{{{tenant}}}:res"))
    usd = tokens = 0
    async for key in store.scan_iter(match=f"ag:{{{tenant}}}:w:*"):
        rusd, rtok = await store.hmget(key, "rusd", "rtok")
        usd, tokens = usd + int(rusd or 0), tokens + int(rtok or 0)
    return open_holds, usd, tokens


async def cut_holds(rig: Rig, ports: tuple[int, int], n: int, seed: int = 22) -> Row:
    server = shutil.which("redis-server")
    if server is None:
        return Row("cut holds", 0, "holds return to zero", "skipped: no redis-server", True)
    port = free_port()
    rig.start([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    wait_ready(port)
    gw = rig.gateway("cut", _cut_policy(*ports, port), {})
    rng = random.Random(seed)
    # Half cut around the reserve itself (its first milliseconds), half anywhere in the stream's ~0.7 s.
    cuts = [rng.uniform(0, 0.01) if i % 2 else rng.uniform(0, 0.8) for i in range(n)]
    store = aioredis.Redis(port=port)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for start in range(0, n, 32):  # 32 at a time: under the tenant's max_concurrent
                await asyncio.gather(*(_cut(http, gw, s) for s in cuts[start:start + 32]))
            left = await settled(http, gw)
            remaining = await held(store)
            for _ in range(50):  # a settle may still be on its way to Redis: at most 5 s
                if remaining == (0, 0, 0):
                    break
                await asyncio.sleep(0.1)
                remaining = await held(store)
    finally:
        await store.aclose()
    holds, usd, tokens = remaining
    return Row(f"cut holds: {n} clients cancel at random points (hard limit, Redis)", n,
               "the tenant's held concurrency and spend return to zero",
               f"{holds} holds open, ${usd / 1e9:.6f} and {tokens} tokens still held; settled: {left}",
               left and remaining == (0, 0, 0))

