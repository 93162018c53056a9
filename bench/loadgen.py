"""A bounded HTTP load generator (closed loop at a concurrency, or open loop at a rate); prints JSON figures."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time

import aiohttp

from bench import agent_bodies

_TURN = itertools.count(random.randrange(1_000_000))

BODY = {"model": "auto", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16}
SUBJECTS = ("the capital of France", "a binary search tree", "photosynthesis", "the French revolution",
            "a hash map", "compound interest", "the speed of light", "a sonnet about rain")
DISTINCT_PROMPTS = 10_000


def payloads(stream: bool) -> list[bytes]:
    """Distinct small chat requests, so no cache keyed by the prompt text flatters the figures."""
    out = []
    for i in range(DISTINCT_PROMPTS):
        subject = SUBJECTS[i % len(SUBJECTS)]
        body = dict(BODY, messages=[{"role": "user", "content": f"Request {i}: explain {subject} briefly."}])
        if stream:
            body["stream"] = True
        out.append(json.dumps(body).encode())
    return out


SESSIONS = [0]  # --sessions N: each call names one of N agent sessions (x-session-id), so the gateway records it
SESSION_NAMES: list[str] = []  # --body agent-*: each body's own session, named as an agent names it


async def one(session: aiohttp.ClientSession, url: str, payload: bytes | list[bytes]) -> tuple[float, float, bool]:
    """(latency_s, ttfb_s, ok) of one request, reading the whole body."""
    headers = {"content-type": "application/json"}
    if isinstance(payload, list):
        turn = next(_TURN) % len(payload)
        payload = payload[turn]
        if SESSION_NAMES:
            headers["x-session-id"] = SESSION_NAMES[turn]
        elif SESSIONS[0]:
            headers["x-session-id"] = f"agent-{turn % SESSIONS[0]}"
    start = time.perf_counter()
    async with session.post(url, data=payload, headers=headers) as resp:
        first = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return end - start, (first or end) - start, resp.status == 200


async def closed(
    url: str, payload: list[bytes], concurrency: int, duration_s: float, max_requests: int
) -> dict[str, float]:
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline and len(latencies) + errors < max_requests:
                latency, ttfb, ok = await one(session, url, payload)
                latencies.append(latency)
                ttfbs.append(ttfb)
                errors += not ok
        await one(session, url, payload)  # warm the connection pool
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return _figures(latencies, ttfbs, errors, elapsed)


async def open_loop(
    url: str, payload: list[bytes], rate: float, duration_s: float, max_in_flight: int
) -> dict[str, float]:
    """Requests start on a fixed schedule; latency counts from the scheduled start (no coordinated omission)."""
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = dropped = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_in_flight)) as session:
        await one(session, url, payload)
        start = time.perf_counter()
        total = int(rate * duration_s)
        tasks: list[asyncio.Task[None]] = []

        async def fire(scheduled: float) -> None:
            nonlocal errors
            latency, ttfb, ok = await one(session, url, payload)
            lag = time.perf_counter() - latency - scheduled
            latencies.append(latency + lag)
            ttfbs.append(ttfb + lag)
            errors += not ok

        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) - len(latencies) >= max_in_flight:
                dropped += 1
                continue
            tasks.append(asyncio.ensure_future(fire(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    figures = _figures(latencies, ttfbs, errors, elapsed)
    figures["dropped"] = dropped
    return figures


def _figures(latencies: list[float], ttfbs: list[float], errors: int, elapsed: float) -> dict[str, float]:
    ordered = sorted(latencies)
    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")
    return {"requests": len(latencies), "errors": errors, "rps": len(latencies) / elapsed,
            "p50_ms": pct(ordered, 0.5), "p99_ms": pct(ordered, 0.99),
            "ttfb_p50_ms": statistics.median(ttfbs) * 1000 if ttfbs else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.0, help="open loop at this many req/s")
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--sessions", type=int, default=0, help="spread the calls over this many agent sessions")
    parser.add_argument("--body", default="chat", choices=("chat", *agent_bodies.KINDS),
                        help="small chats, or coding agents' steps of about that size (bench/agent_bodies.py)")
    args = parser.parse_args()
    if args.body == "chat":
        payload = payloads(args.stream)
    else:
        found = agent_bodies.steps(args.body, args.stream)
        payload, SESSION_NAMES[:] = [raw for raw, _ in found], [name for _, name in found]
    SESSIONS[0] = args.sessions
    import uvloop

    if args.rate:
        result = uvloop.run(open_loop(args.url, payload, args.rate, args.duration_s, 2000))
    else:
        result = uvloop.run(closed(args.url, payload, args.concurrency, args.duration_s, args.max_requests))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
