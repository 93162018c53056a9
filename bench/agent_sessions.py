"""Driver: tool-using agent sessions through a gateway; where their steps went and how long each took.

    .venv/bin/python -m bench.agent_sessions [--url http://127.0.0.1:8080] [--sessions 20] [--steps 12]

Each session opens with a user turn (planning), then feeds back tool results step by step: most are
fine (routine steps), some report an error (`--error-pct`), and some sessions get stuck calling the
same tool with the same arguments a few times in a row (`--loop-pct`), then recover. The conversation
is scripted (what the model answered is not read), so every run sends the same steps. Without --url it
starts its own gateway (policies/default.yaml) over two local fake deployments whose answers take
`--hq-ms` and `--fast-ms` (`--policy` to compare another), so the routing can be watched without vLLM;
with --url it drives a running
one (for example `scripts/up`). Prints the share of steps on each deployment, the escalations, and the
per-step latency by deployment. Every loop is bounded by --sessions x --steps; processes it starts are
stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.proxy_bench import PY, ROOT, free_port, wait_ready
from bench.shadow_bench import start

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("search", "open", "book", "status")]


def _call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def script(rng: random.Random, steps: int, error_pct: float, loop_pct: float) -> list[list[dict[str, Any]]]:
    """The message list of every step of one session (each step's is the one before plus a tool round)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Plan trip {rng.randint(1, 999)} for me."}]
    out = [list(messages)]
    loop_left = 0
    for i in range(1, steps):
        if loop_left == 0 and rng.random() * 100 < loop_pct:
            loop_left = 3
        if loop_left:
            loop_left -= 1
            name, args = "status", {"booking": 7}
        else:
            name, args = rng.choice(("search", "open", "book")), {"n": i}
        failed = not loop_left and rng.random() * 100 < error_pct
        result = "Error: upstream timed out" if failed else json.dumps({"ok": True, "items": i})
        messages += [_call(name, args, f"c{i}"), {"role": "tool", "tool_call_id": f"c{i}", "content": result}]
        out.append(list(messages))
    return out


async def drive(url: str, sessions: int, steps: int, error_pct: float, loop_pct: float, seed: int,
                at_once: int = 0, max_tokens: int = 32) -> list[dict[str, Any]]:
    """Every step's outcome; `at_once` sessions run together (0: all of them)."""
    rng = random.Random(seed)
    scripts = [script(rng, steps, error_pct, loop_pct) for _ in range(sessions)]
    records: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    running = asyncio.Semaphore(at_once or sessions)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def session(index: int, steps_of: list[list[dict[str, Any]]]) -> None:
            async with running:
                await run_steps(index, steps_of)

        async def run_steps(index: int, steps_of: list[list[dict[str, Any]]]) -> None:
            for messages in steps_of:  # one step after another, as an agent would
                body = {"model": "auto", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens}
                started = time.perf_counter()
                async with http.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"x-session-id": f"bench-{seed}-{index}"}) as r:
                    await r.read()
                    records.append({"session": index, "status": r.status,
                                    "deployment": r.headers.get("x-gateway-deployment"),
                                    "rule": r.headers.get("x-gateway-rule"),
                                    "ms": (time.perf_counter() - started) * 1000})

        await asyncio.gather(*(session(i, s) for i, s in enumerate(scripts)))
    return records


def report(records: list[dict[str, Any]]) -> None:
    by_deployment = Counter(r["deployment"] for r in records)
    by_rule = Counter(r["rule"] for r in records)
    total = len(records)
    print(f"steps: {total}, errors: {sum(r['status'] != 200 for r in records)}")
    for name, n in sorted(by_deployment.items()):
        print(f"  on {name}: {n} ({n / total:.0%})")
    escalations = by_rule["tool-error-to-hq"] + by_rule["repeated-call-to-hq"]
    print(f"escalations to hq: {escalations} (tool errors {by_rule['tool-error-to-hq']}, "
          f"repeated calls {by_rule['repeated-call-to-hq']}); planning steps: {by_rule['planning-to-hq']}")
    latencies: dict[str, list[float]] = defaultdict(list)
    for r in records:
        latencies[r["deployment"]].append(r["ms"])
    all_ms = [r["ms"] for r in records]
    # A session's steps run one after another: its duration is what an agent's user waits for.
    sessions: dict[int, float] = defaultdict(float)
    for r in records:
        sessions[r["session"]] += r["ms"]
    print(f"{'latency':<20}{'p50 ms':>10}{'p95 ms':>10}{'mean ms':>10}")
    for name, values in [*sorted(latencies.items()), ("all steps", all_ms), ("whole sessions", [*sessions.values()])]:
        q = statistics.quantiles(values, n=20) if len(values) >= 2 else [values[0]] * 19
        print(f"  {name:<18}{statistics.median(values):>10.1f}{q[18]:>10.1f}{statistics.fmean(values):>10.1f}")


@contextlib.contextmanager
def local_gateway(hq_ms: float, fast_ms: float, policy_path: Path) -> Iterator[str]:
    """A gateway with the policy's rules over two fake deployments of the given answer times."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            hq, fast, gateway = free_port(), free_port(), free_port()
            policy = yaml.safe_load(policy_path.read_text())
            for name, port in (("hq", hq), ("fast", fast)):
                policy["deployments"][name]["url"] = f"http://127.0.0.1:{port}"
            path = Path(tmp) / "policy.yaml"
            path.write_text(yaml.safe_dump(policy))
            procs += [start([PY, "-m", "fakes.openai_upstream", str(hq), str(hq_ms)]),
                      start([PY, "-m", "fakes.openai_upstream", str(fast), str(fast_ms)]),
                      start([PY, "-m", "gateway", "serve", "--port", str(gateway), "--policy", str(path)])]
            for port in (hq, fast, gateway):
                wait_ready(port)
            yield f"http://127.0.0.1:{gateway}"
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway; default: start one over local fake deployments")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--error-pct", type=float, default=15.0)
    parser.add_argument("--loop-pct", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--at-once", type=int, default=0, help="sessions running together (default: all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="each step's max_tokens")
    parser.add_argument("--hq-ms", type=float, default=60.0)
    parser.add_argument("--fast-ms", type=float, default=25.0)
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml",
                        help="without --url: the policy whose rules route (its deployments hq and fast are rewired)")
    args = parser.parse_args()
    if args.url:
        records = asyncio.run(drive(args.url.rstrip("/"), args.sessions, args.steps, args.error_pct,
                                    args.loop_pct, args.seed, args.at_once, args.max_tokens))
    else:
        with local_gateway(args.hq_ms, args.fast_ms, args.policy) as url:
            records = asyncio.run(drive(url, args.sessions, args.steps, args.error_pct, args.loop_pct, args.seed,
                                        args.at_once, args.max_tokens))
    report(records)


if __name__ == "__main__":
    main()
