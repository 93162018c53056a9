"""Driver: what hostile agent input costs the trajectory recorder and the sessions admin API (issue 22, 1 and 3).

    .venv/bin/python -m bench.agent_input_bench [--tool-messages 100000] [--sessions 100000] [--redis]

1. One chat body with `--tool-messages` tool outputs after its last assistant turn, recorded as one agent step
   by the process's recorder (the in-memory store; with --redis also a private redis-server): the time to
   queue it (on the request path; it includes freeing the request's messages when the step held the last
   reference), the time of the flush that records it, the longest the event loop waited during that flush,
   the tool results recorded, and the bytes of the stored step.
2. `/admin/sessions` on the in-memory store holding `--sessions` sessions: the handler's time per sort,
   through a real gateway app (no deployment needed).

Runs against whichever checkout is on the path, so the same command measures before and after a change.
Processes it starts (redis-server) are stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from gateway.decision.call import read_call
from gateway.features import extract
from gateway.policy.model import load
from gateway.server.app import create_app
from gateway.server.resources import STATE
from gateway.server.settings import Settings
from gateway.store.trajectories import Append, encode
from gateway.store.trajectory_memory import MemoryTrajectoryStore
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import make_metrics

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "policies" / "default.yaml"
TOKEN = "bench-admin-token"
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def flood_body(n: int) -> dict[str, Any]:
    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    return {"model": "auto", "tools": TOOLS, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        *({"role": "tool", "tool_call_id": f"t{i}", "content": "x" * 40} for i in range(n))]}


class _Ticker:
    """The longest gap between two turns of a task that only yields: how long the loop was held."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self.longest_s = max(self.longest_s, now - last)
            last = now

    async def __aenter__(self) -> _Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)  # the ticker's first turn: it holds the time from here on
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        await asyncio.sleep(0)  # its turn after the work: the work's last stretch is counted too
        self._task.cancel()


async def record_flood(n: int, store: Any) -> dict[str, float]:
    from gateway.agents.recorder import Trajectories

    policy = load(POLICY)
    recorder = Trajectories(store, lambda: policy, make_metrics())
    body = flood_body(n)
    call = read_call(policy, "chat", body, body, 0, extract(body, "chat"), {"x-session-id": "flood"}, None)
    ex = Exchange("bench-1", "chat", "chat")
    ex.deployment, ex.rule = "fast", "routine-tool-step-to-fast"
    recorder.begin(ex, call, None)
    assert ex.step is not None
    ex.step.raw = json.dumps({"choices": [{"message": {"tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{}"}}]}}]}).encode()
    metrics = make_metrics()
    del body, call  # the step holds the request's messages now, as when the handler has returned
    started = time.perf_counter()
    ex.finish(200, metrics, None)  # queues the step, as the middleware does when the exchange ends
    queued_s = time.perf_counter() - started
    await asyncio.sleep(0.01)
    async with _Ticker() as ticker:
        started = time.perf_counter()
        await recorder.flush()
        flush_s = time.perf_counter() - started
    found = await store.session("h:flood", "anonymous")
    assert found is not None, "the step was not recorded"
    (step,) = found[1]
    return {"queue_ms": queued_s * 1000, "flush_ms": flush_s * 1000, "longest_hold_ms": ticker.longest_s * 1000,
            "tool_results": len(step.tool_results), "stored_step_bytes": len(encode(step))}


async def fill(store: MemoryTrajectoryStore, sessions: int) -> None:
    from gateway.agents.trajectory import Step
    from gateway.policy.agents import Recording

    limits = Recording(max_sessions=max(sessions, 1), max_steps_per_session=5)
    now = time.time()
    batch = []
    for i in range(sessions):
        step = Step(now - sessions + i, "fast", "r", None, 10 + i % 97, 5, (i % 1000) / 1e6, 10.0, None, 200)
        batch.append(Append(f"tenant-{i % 10}", f"s{i}", step, float(i % 13), {}))
        if len(batch) == 5000:
            await store.append(batch, {}, limits)
            batch = []
    await store.append(batch, {}, limits)


async def list_sessions(sessions: int, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(policy=str(POLICY), admin_token=TOKEN)
        app = create_app(settings)
        async with TestClient(TestServer(app)) as client:
            store = app[STATE].trajectories.store
            assert isinstance(store, MemoryTrajectoryStore)
            await fill(store, sessions)
            out = {}
            for sort in ("recent", "cost", "steps", "rate"):
                times = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    resp = await client.get(f"/admin/sessions?sort={sort}&limit=50",
                                            headers={"authorization": f"Bearer {TOKEN}"})
                    assert resp.status == 200, await resp.text()
                    assert len((await resp.json())["data"]) == 50
                    times.append(time.perf_counter() - started)
                out[f"{sort}_ms_median"] = statistics.median(times) * 1000
        del tmp
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tool-messages", type=int, default=100_000)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis", action="store_true", help="also record the flood into a private redis-server")
    args = parser.parse_args()
    print("flood, in-memory store:", await record_flood(args.tool_messages, MemoryTrajectoryStore()))
    if args.redis:
        from gateway.store.trajectories import RedisTrajectoryStore
        from tests.fixtures.redis_server import RedisServer

        with tempfile.TemporaryDirectory() as tmp:
            server = RedisServer(Path(tmp))
            server.start()
            try:
                store = RedisTrajectoryStore(server.url, timeout_s=30.0, prefix="bench")
                print("flood, redis store:", await record_flood(args.tool_messages, store))
                await store.close()
            finally:
                server.kill()
    print(f"/admin/sessions at {args.sessions} sessions:", await list_sessions(args.sessions, args.rounds))


if __name__ == "__main__":
    asyncio.run(main())
