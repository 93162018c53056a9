"""The reliability suite: faults against a real gateway process in front of fake deployments; one table.

    .venv/bin/python -m bench.reliability [--groups faults,memory,agents] [--slow-clients 500]
        [--header-timeout-s 2] [--slow-readers 200] [--slow-read-kib 215] [--rounds 10] [--round-streams 1000]

    .venv/bin/python -m bench.reliability --groups rounds --rounds 5   # RSS after each round of 1,000 streams,
                                                                      # the gateway's beside the minimal proxy's

`fast` is a fake deployment that fails on cue (fakes/openai_upstream.py --faults, picked per request by the
x-fake-fault header), `hq` one that always answers: the policy sends `auto` to fast and fails over to hq.
Every process runs on a free loopback port, is started here and stopped by PID at the end; every loop is
bounded in count and time. Prints one row per fault (requests, expected, observed, pass) and exits 1 when
a row fails. Not a test: the suite under tests/ covers each fault; this runs them at volume, in processes.
The memory rows are in bench/memory_faults.py, the agent rows in bench/agent_faults.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import agent_faults, memory_faults
from bench.proxy_bench import free_port, wait_ready
from bench.rig import HELLO, POLICY, Gateway, Rig, Row, gather


async def _chat(http: aiohttp.ClientSession, gw: Gateway, fault: str = "", **extra: Any) -> tuple[int, str, Any]:
    headers = {"x-fake-fault": fault} if fault else {}
    body = {"model": "auto", "messages": HELLO, **extra}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        text = await resp.text()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text[:60]
        return resp.status, resp.headers.get("x-gateway-deployment", ""), payload


async def _statuses(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, float]:
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            found[status] = found.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def failover(http: aiohttp.ClientSession, gw: Gateway, fault: str, label: str, n: int) -> Row:
    replies = await gather(n, 8, lambda _: _chat(http, gw, fault))
    good = sum(1 for status, dep, payload in replies
               if status == 200 and dep == "hq" and isinstance(payload, dict) and payload.get("choices"))
    return Row(label, n, "200 from hq (failover before the first byte)", f"{good}/{n} 200 from hq", good == n)


async def huge_bodies(http: aiohttp.ClientSession, gw: Gateway, n: int) -> list[Row]:
    before = gw.rss_mib()
    rows = [await failover(http, gw, "huge", "200 + 50 MiB of random bytes (chunked)", n),
            await failover(http, gw, "huge-json", "200 + 50 MiB starting like JSON (chunked)", n)]
    grown = gw.rss_mib() - before
    rows.append(Row(f"gateway RSS after those {2 * n} bodies", 2 * n, "grows < 40 MiB (bounded read)",
                    f"{before:.0f} -> {before + grown:.0f} MiB ({grown:+.0f})", grown < 40))
    return rows


async def mid_stream_death(http: aiohttp.ClientSession, gw: Gateway, n: int) -> Row:
    async def one(_: int) -> bool:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": HELLO,
                             "stream": True}, headers={"x-fake-fault": "die-mid-stream"}) as resp:
            events = [e for e in (await resp.text()).split("\n\n") if e.strip()]
        return events[-1].startswith('data: {"error"') and "[DONE]" not in events[-1]

    ended = sum(await gather(n, 8, one))
    return Row("deployment dies mid-stream", n, "one SSE error event, never a silent truncation",
               f"{ended}/{n} ended with an error event", ended == n)


async def client_disconnects(http: aiohttp.ClientSession, gw: Gateway, n: int) -> Row:
    before = await _statuses(http, gw)

    async def one(_: int) -> None:
        resp = await http.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": HELLO,
                               "stream": True}, headers={"x-fake-fault": "slow"})
        for _ in range(16):  # of 64 chunks, 10 ms apart
            await resp.content.readuntil(b"\n\n")
        resp.close()

    await gather(n, 32, one)
    delta: dict[str, float] = {}
    for _ in range(50):  # the gateway records each once its handler is cancelled: at most a few seconds
        after = await _statuses(http, gw)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        if sum(delta.values()) >= n:
            break
        await asyncio.sleep(0.1)
    tracebacks = gw.log.read_text(errors="replace").count("Traceback")
    observed = ", ".join(f"{int(v)} x {k}" for k, v in sorted(delta.items())) + f"; {tracebacks} tracebacks"
    return Row("client hangs up mid-stream (16 of 64 chunks)", n, f"{n} x 499, no 500, no traceback",
               observed, delta == {"499": n} and tracebacks == 0)


async def slow_headers(gw: Gateway, n: int, timeout_s: float) -> Row:
    host, port = gw.url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n" * 4

    async def one(_: int) -> tuple[float, bytes]:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(host, int(port))

        async def trickle() -> None:
            for byte in head[: int(timeout_s) + 30]:  # one byte a second, bounded
                writer.write(bytes([byte]))
                await asyncio.sleep(1.0)

        dripping = asyncio.ensure_future(trickle())
        try:
            async with asyncio.timeout(timeout_s + 20):
                answer = await reader.read()
        except (TimeoutError, ConnectionError):
            answer = b""
        finally:
            dripping.cancel()
            writer.close()
        return time.monotonic() - started, answer

    results = await gather(n, n, one)
    cut = [t for t, answer in results if answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer]
    slowest = max((t for t, _ in results), default=0.0)
    return Row(f"{n} clients trickling headers at 1 byte/s", n,
               f"408 envelope, closed after ~{timeout_s:g} s (header timeout)",
               f"{len(cut)}/{n} got 408; the last closed after {slowest:.1f} s",
               len(cut) == n and slowest < timeout_s + 3)


async def over_long_header(http: aiohttp.ClientSession, gw: Gateway, n: int) -> Row:
    async def one(_: int) -> bool:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": HELLO},
                             headers={"x-session-id": "s" * 60_000}) as resp:
            return resp.status == 431 and (await resp.json())["error"]["code"] == "header_too_large"

    good = sum(await gather(n, 4, one))
    return Row("60 KB x-session-id header", n, "431 in the OpenAI envelope", f"{good}/{n} enveloped 431", good == n)


async def pool_saturation(rig: Rig, ports: tuple[int, int], n: int) -> Row:
    """4 connections per deployment; fast holds every request: the rest wait at most connect_s, fail over."""
    policy = POLICY.format(fast=ports[0], hq=ports[1])
    gw = rig.gateway("saturated", policy, {"AGENT_GATEWAY_UPSTREAM_CONNECTIONS": "4"})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        started = time.monotonic()
        replies = await gather(n, n, lambda _: _chat(http, gw, "hold"))
        took = time.monotonic() - started
        async with http.get(gw.url + "/readyz") as resp:
            healthy = (await resp.json()).get("healthy_deployments", [])
    good = sum(1 for status, dep, _ in replies if status == 200 and dep == "hq")
    return Row(f"{n} requests at a 4-connection pool, fast stalled", n,
               "all 200 from hq within read_s + connect_s; fast still healthy",
               f"{good}/{n} from hq in {took:.1f} s; healthy: {', '.join(healthy)}",
               good == n and took < 8 and "fast" in healthy)


async def dead_redis(rig: Rig, ports: tuple[int, int], n: int) -> Row:
    server = shutil.which("redis-server")
    if server is None:
        return Row("Redis killed under accounting", 0, "served locally (allow)", "skipped: no redis-server", True)
    port = free_port()
    pid = rig.start([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    wait_ready(port)
    policy = POLICY.format(fast=ports[0], hq=ports[1]) + (
        f'store: {{redis_url: "redis://127.0.0.1:{port}/0", on_unavailable: allow, timeout_s: 0.25}}\n'
        'tenants:\n  - name: "*"\n    budgets: [{window: day, hard_usd: 1000}]\n')
    gw = rig.gateway("redis", policy, {})
    async with aiohttp.ClientSession() as http:
        warm = await gather(5, 5, lambda _: _chat(http, gw))
        os.kill(pid, signal.SIGKILL)
        replies = await gather(n, 8, lambda _: _chat(http, gw))
        async with http.get(gw.url + "/metrics") as resp:
            degraded = "gateway_store_degraded 1.0" in await resp.text()
    good = sum(1 for status, _, _ in replies if status == 200)
    return Row("Redis killed under accounting (allow)", n, "served, accounted locally; degraded shown",
               f"{good}/{n} 200; gateway_store_degraded={int(degraded)}",
               good == n and degraded and all(s == 200 for s, _, _ in warm))


GROUPS = ("faults", "resume", "memory", "agents", "rounds")
# A pair of one deterministic model family (fakes/greedy_vllm.py), so a resumed answer can be compared with
# the uninterrupted one; a short read timeout, so a stall is seen as one.
RESUME_POLICY = POLICY.replace("resume: {{enabled: false}}", "resume: {{enabled: true, max: 1}}").replace(
    "read_s: 2", "read_s: 1")


async def resume(args: argparse.Namespace, rig: Rig, ports: tuple[int, int]) -> list[Row]:
    """Deaths and stalls mid-stream, resumed on the sibling: every client stream complete and equal to the
    uninterrupted answer (the pair's greedy answers are the same)."""
    fast, hq = free_port(), free_port()
    for port in (fast, hq):
        rig.start([sys.executable, "-m", "fakes.greedy_vllm", str(port), "bench"])
        wait_ready(port)
    gw = rig.gateway("resume", RESUME_POLICY.format(fast=fast, hq=hq), {})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        whole = await _streamed_text(http, gw, "")
        rows = [await _resumed(http, gw, whole, "die", "deployment dies mid-stream, resumed on hq", 100),
                await _resumed(http, gw, whole, "stall", "deployment stalls mid-stream (1 s), resumed on hq", 20)]
    rig.stop([gw.pid])
    return rows


async def _resumed(http: aiohttp.ClientSession, gw: Gateway, whole: str, kind: str, label: str, n: int) -> Row:
    async def one(i: int) -> bool:
        return await _streamed_text(http, gw, f"{kind}-after-{1 + i % 11}") == whole  # cut at every point

    equal = sum(await gather(n, 8, one))
    return Row(label, n, "every stream complete, equal to the uninterrupted answer",
               f"{equal}/{n} complete and equal", equal == n)


async def _streamed_text(http: aiohttp.ClientSession, gw: Gateway, fault: str) -> str:
    """The text of one streamed answer; "" unless it ended as one answer does: one finish, then [DONE]."""
    async with http.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": HELLO, "stream": True,
                         "temperature": 0}, headers={"x-fake-fault": fault} if fault else {}) as resp:
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e.strip()]
    if not events or events[-1] != "[DONE]":
        return ""
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["finish_reason"] for e in chunks for c in e.get("choices", ()) if c.get("finish_reason")]
    if len(finishes) != 1 or any("error" in e for e in chunks):
        return ""
    return "".join((c.get("delta") or {}).get("content") or "" for e in chunks for c in e.get("choices", ()))


async def faults(args: argparse.Namespace, rig: Rig, ports: tuple[int, int]) -> list[Row]:
    env = {"AGENT_GATEWAY_HEADER_TIMEOUT_S": str(args.header_timeout_s)}
    gw = rig.gateway("gateway", POLICY.format(fast=ports[0], hq=ports[1]), env)
    rows: list[Row] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        rows.append(await failover(http, gw, "503", "503 before the first byte", 100))
        rows.append(await failover(http, gw, "html", "200 + an HTML page", 100))
        rows.append(await failover(http, gw, "garbage", "200 + 64 KiB of random bytes", 100))
        rows += await huge_bodies(http, gw, 10)
        rows.append(await mid_stream_death(http, gw, 100))  # with resume off: the "resume" group resumes them
        rows.append(await client_disconnects(http, gw, 200))
        rows.append(await over_long_header(http, gw, 20))
    rows.append(await slow_headers(gw, args.slow_clients, args.header_timeout_s))
    rig.stop([gw.pid])
    rows.append(await pool_saturation(rig, ports, 16))
    rows.append(await dead_redis(rig, ports, 50))
    return rows


async def memory(args: argparse.Namespace, rig: Rig, ports: tuple[int, int]) -> list[Row]:
    """Each on a fresh gateway: what it measures is its own traffic's memory."""
    policy = memory_faults.POLICY.format(fast=ports[0])
    gw = rig.gateway("slow-readers", policy, {})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        rows = [await memory_faults.slow_readers(http, gw, args.slow_readers, args.slow_read_kib, args.slow_read_s)]
    rig.stop([gw.pid])
    gw, yardstick = rig.gateway("rounds", policy, {}), rig.minimal_proxy(ports[0])
    rows.append(await memory_faults.stream_rounds(gw, yardstick, args.rounds, args.round_streams))
    rig.stop([gw.pid, yardstick.pid])
    gw = rig.gateway("headers", policy, {})
    rows.append(await memory_faults.padded_headers(gw, 200))
    rig.stop([gw.pid])
    return rows


async def rounds(args: argparse.Namespace, rig: Rig, ports: tuple[int, int]) -> list[Row]:
    """The memory group's rounds of concurrent streams alone, on a fresh gateway, RSS after every round."""
    gw, yardstick = rig.gateway("rounds", memory_faults.POLICY.format(fast=ports[0]), {}), rig.minimal_proxy(ports[0])
    row = await memory_faults.stream_rounds(gw, yardstick, args.rounds, args.round_streams, every_round=True)
    rig.stop([gw.pid, yardstick.pid])
    return [row]


async def agents(args: argparse.Namespace, rig: Rig, ports: tuple[int, int]) -> list[Row]:
    return [await agent_faults.agent_bad_input(rig, ports, 3), await agent_faults.cut_holds(rig, ports, 400)]


async def run(args: argparse.Namespace, rig: Rig) -> list[Row]:
    ports = rig.fakes()
    rows: list[Row] = []
    for group in args.groups.split(","):
        rows += await {"faults": faults, "resume": resume, "memory": memory, "agents": agents,
                         "rounds": rounds}[group](args, rig, ports)
    return rows


def render(rows: list[Row]) -> str:
    lines = ["| fault | requests | expected | observed | pass |", "|---|---|---|---|---|"]
    lines += [f"| {r.fault} | {r.requests} | {r.expected} | {r.observed} | {'pass' if r.ok else 'FAIL'} |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow-clients", type=int, default=500, help="connections trickling their headers")
    parser.add_argument("--header-timeout-s", type=float, default=2.0, help="the gateway's header timeout")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    parser.add_argument("--slow-readers", type=int, default=200, help="clients reading a 4 MiB stream slowly")
    parser.add_argument("--slow-read-kib", type=int, default=215, help="what each of them reads before leaving")
    parser.add_argument("--slow-read-s", type=float, default=4.0, help="over this many seconds")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of concurrent streams")
    parser.add_argument("--round-streams", type=int, default=1000, help="concurrent 64-chunk streams a round")
    args = parser.parse_args()
    if unknown := set(args.groups.split(",")) - set(GROUPS):
        parser.error(f"unknown groups: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="reliability-") as folder:
        rig = Rig(Path(folder))
        try:
            rows = asyncio.run(run(args, rig))
        finally:
            rig.stop()
    print(render(rows))
    sys.exit(0 if all(r.ok for r in rows) else 1)


if __name__ == "__main__":
    main()
