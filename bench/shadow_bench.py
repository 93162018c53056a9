"""Benchmark: primary latency with no shadow vs with every request mirrored to a target that stalls 10 s.

    .venv/bin/python -m bench.shadow_bench [--rounds 2] [--duration-s 4] [--rate 100]

Two gateways over the same fast fake upstream, one with a 100% shadow onto a deployment that answers
nothing for 10 s (per-target cap 8, timeout 10 s), measured interleaved with the same open-loop load.
Prints p50/p99 per gateway and the shadow counters. Every process is started here on free loopback
ports and stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from aiohttp import web

from bench.proxy_bench import PY, ROOT, free_port, measure, wait_ready

STALL_S = 10.0


def stall_server(port: int) -> None:
    """A deployment that takes every request and answers nothing for STALL_S."""

    async def chat(request: web.Request) -> web.Response:
        await asyncio.sleep(STALL_S)
        return web.json_response({"error": {"message": "stalled"}}, status=503)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def policy(fast_url: str, stall_url: str, shadow: bool, directory: str) -> str:
    # One attempt and no ejection: a health blip on a loaded machine must not send primaries to the
    # stalling deployment, or the figures would measure failover instead of shadow isolation.
    deployment = {
        "served_model": "bench",
        "health": {"interval_s": 1, "timeout_s": 5, "eject_after_failures": 1000},
    }
    doc: dict[str, object] = {
        "version": 1,
        "deployments": {"fast": {**deployment, "url": fast_url}, "hq": {**deployment, "url": stall_url}},
        "models": {"auto": {"route": "rules"}, "hq": {"pin": "hq"}, "fast": {"pin": "fast"}},
        "default": "fast",
        "fallback": ["fast"],
        "max_attempts": 1,
    }
    if shadow:
        doc["shadows"] = [
            {
                "route": "auto",
                "target": "deployment:hq",
                "percent": 100,
                "sample_by": "random",
                "max_in_flight": 8,
                "timeout_s": STALL_S,
                "max_tokens": 64,
            }
        ]
    path = Path(directory) / f"policy-{'shadow' if shadow else 'plain'}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def start(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AGENT_GATEWAY_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        args, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def shadow_counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("gateway_shadow_dropped_total{", "gateway_shadow_requests_total{")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run(rounds: int, duration_s: float, rate: float) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            up, stall, plain, mirrored = free_port(), free_port(), free_port(), free_port()
            procs.append(start([PY, "-m", "fakes.openai_upstream", str(up)]))
            procs.append(start([PY, "-m", "bench.shadow_bench", "--stall-server", str(stall)]))
            fast_url, stall_url = f"http://127.0.0.1:{up}", f"http://127.0.0.1:{stall}"
            for port, shadow in ((plain, False), (mirrored, True)):
                procs.append(
                    start(
                        [
                            PY,
                            "-m",
                            "gateway",
                            "serve",
                            "--port",
                            str(port),
                            "--policy",
                            policy(fast_url, stall_url, shadow, tmp),
                        ]
                    )
                )
            for port in (up, stall, plain, mirrored):
                wait_ready(port)
            time.sleep(1.5)  # first health probes
            results: dict[str, list[dict[str, float]]] = {"no shadow": [], "shadow stalls 10 s": []}
            extra = ["--rate", str(rate)]
            for r in range(rounds):
                for name, port in (("no shadow", plain), ("shadow stalls 10 s", mirrored)):
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    results[name].append(measure(url, extra, duration_s))
                print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
            report(results, shadow_counters(mirrored), rate)
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=15)


def report(results: dict[str, list[dict[str, float]]], counters: dict[str, float], rate: float) -> None:
    print(f"open loop {rate:g} req/s, median over rounds")
    print(f"{'gateway':22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for name, samples in results.items():
        med = {k: statistics.median(s[k] for s in samples) for k in ("rps", "p50_ms", "p99_ms")}
        errors = sum(int(s["errors"]) for s in samples)
        print(f"{name:22} {med['rps']:8.0f} {med['p50_ms']:8.2f} {med['p99_ms']:8.2f} {errors:7d}")
    print("\nshadow counters of the mirrored gateway:")
    for name, value in sorted(counters.items()):
        print(f"  {name} {value:g}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--stall-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stall_server:
        stall_server(args.stall_server)
        return
    run(args.rounds, args.duration_s, args.rate)


if __name__ == "__main__":
    main()
