"""Benchmark: what each of the gateway's own stages costs per request inside the running gateway, under load.

    .venv/bin/python -m bench.stages_in_situ [--duration-s 8] [--concurrency 16] [--body agent-100k]

bench.request_stages times the pure stages in a warm loop on one core, where every table and object stays in
cache; inside a loaded gateway the same code costs two to four times as much (the event loop, aiohttp and the
upstream client evict it between requests). This starts the benchmark's fake upstream, its trace sink and a
gateway whose stage functions are wrapped in thread-CPU timers, drives it with bench.loadgen, and prints each
stage's CPU per request beside the process's whole CPU per request. Spans on, the default policy, as
bench.proxy_bench runs it. A timed call pays the timer itself (printed as its overhead); nested stages include
their children's.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import agent_bodies
from bench.proxy_bench import PY, ROOT, cpu_s, free_port, gateway_policy, start, wait_ready

# (module, function or Class.method, depth in the table): sync stages of the request path, in its order
STAGES = [
    ("gateway.telemetry.exchange", "Exchange.__init__", 0),
    ("gateway.telemetry.spans", "Spans.begin", 0),
    ("gateway.apis.chat.adapter", "OpenAIAdapter.parse", 0),
    ("gateway.apis.json_body", "read", 1),
    ("gateway.apis.recurring", "Recurring.elements", 2),
    ("gateway.apis.chat.adapter", "OpenAIAdapter.features", 0),
    ("gateway.features", "count_exact", 1),
    ("gateway.features", "has_code", 1),
    ("gateway.features", "has_math", 1),
    ("gateway.decision.call", "read_call", 0),
    ("gateway.agents.steps", "read_step", 1),
    ("gateway.server.session_caches", "SessionCaches.sighting", 0),
    ("gateway.context.prefix", "chain_of", 1),
    ("gateway.server.pipeline", "surroundings", 0),
    ("gateway.decision.gathering", "gather", 0),
    ("gateway.classifier.scoring", "Classifier.logit", 1),
    ("gateway.classifier.cues", "read_cues", 2),
    ("gateway.classifier.scoring", "Classifier.text_logit", 2),
    ("gateway.server.live_scores", "LiveScoring.thresholds", 1),
    ("gateway.decision.routing", "decide", 0),
    ("gateway.server.pipeline", "record", 0),
    ("gateway.upstream.forward", "forwardable", 0),
    ("gateway.apis.chat.adapter", "OpenAIAdapter.upstream_body", 0),
    ("gateway.apis.json_body", "Source.members", 1),
    ("gateway.server.relay", "_relay_body", 0),
    ("gateway.telemetry.exchange", "Exchange.finish", 0),
    ("gateway.telemetry.spans", "Spans.record", 1),
]
_CLOCK = time.thread_time_ns


def _timed(function: Callable[..., Any], tally: list[int]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = _CLOCK()
        try:
            return function(*args, **kwargs)
        finally:
            tally[0] += _CLOCK() - started
            tally[1] += 1

    return timed


def _install(tallies: dict[str, list[int]]) -> None:
    """Wrap each stage where it is defined and wherever a loaded module imported it by name."""
    for module_name, qualified, _ in STAGES:
        module = importlib.import_module(module_name)
        *owner_path, attr = qualified.split(".")
        owner: Any = getattr(module, owner_path[0]) if owner_path else module
        original = getattr(owner, attr)
        tallies[qualified] = tally = [0, 0]
        setattr(owner, attr, _timed(original, tally))
        if not owner_path:
            for other in list(sys.modules.values()):
                if other is not None and other is not module and getattr(other, attr, None) is original:
                    setattr(other, attr, getattr(owner, attr))


def _timer_overhead_ns() -> float:
    tally = [0, 0]
    nothing = _timed(lambda: None, tally)
    rounds = 20_000
    started = _CLOCK()
    for _ in range(rounds):
        nothing()
    return (_CLOCK() - started) / rounds


def _time_collections(tallies: dict[str, list[int]]) -> None:
    """The cyclic collector's passes, per generation, timed like a stage (they run inside whichever stage
    allocates past the threshold, whose figure includes them)."""
    started = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = _CLOCK()
            return
        tally = tallies[f"gc generation {info['generation']}"]
        tally[0] += _CLOCK() - started[0]
        tally[1] += 1

    for generation in range(3):
        tallies[f"gc generation {generation}"] = [0, 0]
    gc.callbacks.append(callback)


def serve(out: str, gateway_args: list[str]) -> int:
    """The child: the gateway with its stages timed; the tallies written to `out` when it exits."""
    tallies: dict[str, list[int]] = {}
    _install(tallies)
    _time_collections(tallies)
    overhead = _timer_overhead_ns()
    atexit.register(lambda: Path(out).write_text(json.dumps({"overhead_ns": overhead, "stages": tallies})))
    from gateway.cli.command import main as gateway_main

    return gateway_main(["serve", *gateway_args])


def run(duration_s: float, concurrency: int, body: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        up_port, sink_port, port = free_port(), free_port(), free_port()
        upstream, out = f"http://127.0.0.1:{up_port}", str(Path(tmp) / "stages.json")
        procs = [start([PY, "-m", "fakes.openai_upstream", str(up_port)]),
                 start([PY, "-m", "fakes.trace_sink", str(sink_port)])]
        policy = gateway_policy(upstream, tmp, ROOT / "policies" / "default.yaml", False, "in-situ")
        env = {"AGENT_GATEWAY_LOG_LEVEL": "WARNING", "AGENT_GATEWAY_TRACES": "otlp",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces"}
        gateway = start([PY, "-m", "bench.stages_in_situ", "--serve", out, "--policy", policy, "--port", str(port)],
                        env=env)
        try:
            for each in (up_port, sink_port, port):
                wait_ready(each)
            time.sleep(1.0)  # first health probes
            before = cpu_s([gateway.pid])
            load = subprocess.run([PY, "-m", "bench.loadgen", "--url", f"http://127.0.0.1:{port}/v1/chat/completions",
                                   "--duration-s", str(duration_s), "--concurrency", str(concurrency),
                                   "--body", body],
                                  cwd=ROOT, capture_output=True, text=True, timeout=duration_s * 4 + 60, check=True)
            process_cpu_s = cpu_s([gateway.pid]) - before
        finally:
            os.killpg(gateway.pid, signal.SIGINT)
            gateway.wait(timeout=30)
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
        report(json.loads(load.stdout), concurrency, process_cpu_s, json.loads(Path(out).read_text()))


def report(load: dict[str, float], concurrency: int, process_cpu_s: float, found: dict[str, Any]) -> None:
    requests = int(load["requests"]) + 1  # the load generator's warm-up request too
    overhead_ns = found["overhead_ns"]
    print(f"{requests} requests at c={concurrency}: {load['rps']:.0f} req/s, "
          f"gateway process CPU {process_cpu_s / requests * 1e6:.0f} µs per request")
    print(f"a timed call pays ~{overhead_ns / 1000:.2f} µs for its timer: taken off each stage's own figure, "
          "not off its parent's\n")
    print(f"{'stage (thread CPU per request)':48} {'µs':>7} {'calls':>6}")
    for _, qualified, depth in STAGES:
        total_ns, calls = found["stages"][qualified]
        own_ns = max(total_ns - calls * overhead_ns, 0)
        print(f"{'  ' * depth + qualified:48} {own_ns / requests / 1000:7.1f} {calls / requests:6.2f}")
    for generation in range(3):
        total_ns, calls = found["stages"][f"gc generation {generation}"]
        print(f"{f'gc generation {generation} (inside the stages)':48} {total_ns / requests / 1000:7.1f} "
              f"{calls / requests:6.2f}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--body", default="chat", choices=("chat", *agent_bodies.KINDS),
                        help="small chats, or coding agents' steps of about that size (bench/agent_bodies.py)")
    args = parser.parse_args()
    run(args.duration_s, args.concurrency, args.body)


if __name__ == "__main__":
    main()
