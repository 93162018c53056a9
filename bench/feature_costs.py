"""Benchmark: what each of the gateway's features costs a request, taken away one at a time, beside the minimal proxy.

    .venv/bin/python -m bench.feature_costs [--body agent-100k] [--concurrency 8] [--rounds 2] [--duration-s 6]

The same load (bench.loadgen against the benchmark's fake upstream) runs against a ladder of gateways, each the one
before it with one more feature off: span export (AGENT_GATEWAY_TRACES=otlp -> none), the policy's `switch` (the
sessions' prefix caches, their warm-ups), agent trajectories (`agents.record.enabled: false`), every routing rule
(the default deployment for all), `resume`; then the 60-line minimal proxy. Each rung prints its CPU a request
(the gateway's process and its span export process, from /proc) and req/s, the median over the rounds, and what the
feature it took away cost. Rungs interleave round by round, so the machine's drift spreads over all of them.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import yaml

from bench import agent_bodies
from bench.proxy_bench import PY, ROOT, free_port, measure, start, wait_ready


def _no_switch(policy: dict[str, Any]) -> None:
    policy.pop("switch", None)


def _no_trajectories(policy: dict[str, Any]) -> None:
    policy.setdefault("agents", {}).setdefault("record", {})["enabled"] = False


def _no_rules(policy: dict[str, Any]) -> None:
    policy["rules"] = []


def _no_resume(policy: dict[str, Any]) -> None:
    policy["resume"] = {"enabled": False}


# (what the rung takes away, its change to the policy; None: the span export); each rung keeps the ones before it.
LADDER = [
    ("span export", None),
    ("switch (sessions' prefix caches)", _no_switch),
    ("agent trajectories", _no_trajectories),
    ("routing rules", _no_rules),
    ("resume", _no_resume),
]


def rung_policies(source: dict[str, Any], upstream: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, policy, spans exported) of each rung: the source policy first, then each feature taken away in turn."""
    policy = copy.deepcopy(source)
    for dep in policy["deployments"].values():
        dep["url"] = upstream
        dep["health"]["interval_s"] = 1
    rungs = [("the policy as written, spans exported", copy.deepcopy(policy), True)]
    spans = True
    for name, change in LADDER:
        if change is None:
            spans = False
        else:
            change(policy)
        rungs.append((f"- {name}", copy.deepcopy(policy), spans))
    return rungs


def _measure(argv: list[str], env: dict[str, str] | None, port: int, args: argparse.Namespace) -> tuple[float, float]:
    """Start the process, warm it with one run of the load, measure the next, stop it."""
    proc = start(argv, env=env)
    try:
        wait_ready(port)
        time.sleep(1.0)  # the first health probes
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        load = ["--concurrency", str(args.concurrency), "--body", args.body]
        measure(url, load, min(args.duration_s, 2.0), proc.pid)
        figures = measure(url, load, args.duration_s, proc.pid)
        return figures["cpu_us_per_req"], figures["rps"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)


def run(args: argparse.Namespace) -> list[tuple[str, list[tuple[float, float]]]]:
    with tempfile.TemporaryDirectory() as tmp:
        up_port, sink_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        fakes = [start([PY, "-m", "fakes.openai_upstream", str(up_port)]),
                 start([PY, "-m", "fakes.trace_sink", str(sink_port)])]
        rungs = rung_policies(yaml.safe_load(Path(args.policy).read_text()), upstream)
        found: list[tuple[str, list[tuple[float, float]]]] = [(name, []) for name, _, _ in rungs]
        found.append(("minimal proxy", []))
        try:
            for each in (up_port, sink_port):
                wait_ready(each)
            for _ in range(args.rounds):
                for (_, policy, spans), (_, figures) in zip(rungs, found, strict=False):
                    path = Path(tmp) / "policy.yaml"
                    path.write_text(yaml.safe_dump(policy))
                    port = free_port()
                    env = {"AGENT_GATEWAY_LOG_LEVEL": "WARNING", "AGENT_GATEWAY_TRACES": "otlp" if spans else "none",
                           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces"}
                    figures.append(_measure([PY, "-m", "gateway", "serve", "--policy", str(path), "--port", str(port)],
                                            env, port, args))
                port = free_port()
                found[-1][1].append(_measure([PY, "-m", "bench.minimal_proxy", str(port), upstream], None, port, args))
        finally:
            for proc in fakes:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
        return found


def report(found: list[tuple[str, list[tuple[float, float]]]], args: argparse.Namespace) -> None:
    print(f"{args.body} at c={args.concurrency}, {args.rounds} round(s) of {args.duration_s:g} s, median "
          f"({Path(args.policy).name})")
    print(f"{'gateway':44} {'CPU µs/req':>10} {'req/s':>7} {'it cost':>8}")
    before: float | None = None
    for name, figures in found:
        cpu, rps = median(c for c, _ in figures), median(r for _, r in figures)
        cost = f"{before - cpu:+7.0f}" if before is not None and name != "minimal proxy" else ""
        print(f"{name:44} {cpu:10.0f} {rps:7.0f} {cost:>8}")
        before = cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--body", default="agent-100k", choices=("chat", *agent_bodies.KINDS))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--policy", default=str(ROOT / "policies" / "default.yaml"))
    args = parser.parse_args()
    report(run(args), args)


if __name__ == "__main__":
    main()
