"""Benchmark: direct to a fake upstream vs a minimal aiohttp proxy vs the gateway, interleaved, one run.

    .venv/bin/python -m bench.proxy_bench [--rounds 3] [--duration-s 3] [--workers 1] [--sessions N]
    .venv/bin/python -m bench.proxy_bench --body agent-100k     coding agents' steps (bench/agent_bodies.py)

Prints req/s and latency per scenario and target (median over rounds) and the ratios the core issue
asks for. Every process is started here on free loopback ports and stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench import agent_bodies

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SCENARIOS = [
    ("non-stream c=32", ["--concurrency", "32"]),
    ("non-stream c=1", ["--concurrency", "1"]),
    ("stream 64 chunks c=16", ["--concurrency", "16", "--stream"]),
    ("open loop 400 req/s", ["--rate", "400"]),
]
# Coding agents' steps (--body agent-*): an agent waits on each step, so a gateway sees few at once.
AGENT_SCENARIOS = [
    ("non-stream c=8", ["--concurrency", "8"]),
    ("stream 64 chunks c=8", ["--concurrency", "8", "--stream"]),
    ("non-stream c=1", ["--concurrency", "1"]),
]
TARGETS = ("direct", "minimal proxy", "gateway")
NO_SCORE = "gw w/o score"  # with --without-classifier: the same gateway and policy minus its score rules


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on port {port} after {timeout_s}s")


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def gateway_policy(upstream: str, directory: str, source: Path, without_classifier: bool, name: str,
                   health_interval_s: float = 1) -> str:
    policy = yaml.safe_load(source.read_text())
    if without_classifier:  # to measure what the classifier costs: the same policy minus score rules
        policy["rules"] = [r for r in policy.get("rules", []) if "complexity" not in r.get("when", {})]
    for dep in policy["deployments"].values():
        dep["url"] = upstream
        dep["health"]["interval_s"] = health_interval_s
        if health_interval_s > 1:  # the load is read as often as the health (the watch's period is the lesser)
            dep.setdefault("load", {})["scrape_interval_s"] = health_interval_s
    path = Path(directory) / f"bench-policy-{name.replace(' ', '-').replace('/', '')}.yaml"
    path.write_text(yaml.safe_dump(policy))
    return str(path)


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children (the gateway's workers)."""
    total = 0.0
    for pid in pids:
        for task in [pid, *_children(pid)]:
            try:
                fields = Path(f"/proc/{task}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    """Every descendant: a gateway's workers (--workers N) and each one's span export process."""
    try:
        found = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [each for child in found for each in (child, *_children(child))]


def _is_span_export(pid: int) -> bool:
    try:
        return b"gateway.telemetry.export_child" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def measure(url: str, extra: list[str], duration_s: float, pid: int | None = None, scored: bool = False
            ) -> dict[str, float]:
    """Load figures for one target; CPU per request from /proc, and for a gateway (scored=True) the time
    its classifier took per request, from its own gateway_classifier_seconds_total."""
    scoring_before = scoring_s(url) if scored else 0.0  # scraped outside the CPU window
    before = cpu_s([pid]) if pid else 0.0
    out = subprocess.run([PY, "-m", "bench.loadgen", "--url", url, "--duration-s", str(duration_s), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=duration_s * 4 + 60, check=True)
    figures: dict[str, float] = json.loads(out.stdout)
    requests = figures["requests"] + 1  # the load generator's one warm-up request too
    figures["cpu_us_per_req"] = (cpu_s([pid]) - before) / requests * 1e6 if pid else 0.0
    if scored:
        figures["score_us_per_req"] = (scoring_s(url) - scoring_before) / requests * 1e6
    return figures


def scoring_s(url: str) -> float:
    """gateway_classifier_seconds_total of the gateway serving url (one worker's, with --workers N)."""
    with urllib.request.urlopen(url.replace("/v1/chat/completions", "/metrics"), timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("gateway_classifier_seconds_total "):
                return float(line.split()[1])
    return 0.0


Results = dict[str, dict[str, list[dict[str, float]]]]


def run(
    rounds: int, duration_s: float, workers: int, policy: Path, without_classifier: bool, only: str | None,
    traces: bool, sessions: int = 0, body: str = "chat",
) -> tuple[Results, int, dict[str, float]]:
    """Figures per scenario and target, how many spans the gateways exported meanwhile, and the proxies' resident
    memory after the run (MiB)."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            up_port, min_port, sink_port = free_port(), free_port(), free_port()
            upstream = f"http://127.0.0.1:{up_port}"
            procs.append(start([PY, "-m", "fakes.openai_upstream", str(up_port)]))
            procs.append(start([PY, "-m", "fakes.trace_sink", str(sink_port)]))
            ports: dict[str, int] = {"direct": up_port, "minimal proxy": min_port}
            pids: dict[str, int | None] = {"direct": None}
            procs.append(start([PY, "-m", "bench.minimal_proxy", str(min_port), upstream]))
            pids["minimal proxy"] = procs[-1].pid
            gateways = {"gateway": False, **({NO_SCORE: True} if without_classifier else {})}
            for name, drop_score_rules in gateways.items():
                ports[name] = free_port()
                procs.append(start([PY, "-m", "gateway", "serve", "--policy",
                                    gateway_policy(upstream, tmp, policy, drop_score_rules, name),
                                    "--port", str(ports[name]), "--workers", str(workers)],
                                   env={"AGENT_GATEWAY_LOG_LEVEL": "WARNING", **_telemetry_env(traces, sink_port)}))
                pids[name] = procs[-1].pid
            for port in (*ports.values(), sink_port):
                wait_ready(port)
            time.sleep(1.0)  # first health probes
            urls = {name: f"http://127.0.0.1:{port}/v1/chat/completions" for name, port in ports.items()}
            scenarios = [(name, [*extra, *(["--sessions", str(sessions)] if sessions else []), "--body", body])
                         for name, extra in (SCENARIOS if body == "chat" else AGENT_SCENARIOS)
                         if only is None or f" {only} " in f" {name} "]
            results: Results = {s: {t: [] for t in ports} for s, _ in scenarios}
            for r in range(rounds):
                for scenario, extra in scenarios:
                    # interleaved, so drift hits every target alike, and in an order rotated each round, so
                    # no target always follows the same one (whose leftover work it would pay for)
                    targets = list(ports)
                    for target in targets[r % len(targets):] + targets[:r % len(targets)]:
                        results[scenario][target].append(measure(urls[target], extra, duration_s, pids[target],
                                                                 scored=target == "gateway" and workers == 1))
                print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
            time.sleep(_EXPORT_WAIT_S if traces else 0)
            rss = {name: _rss_mib(pid, span_export=False) for name, pid in pids.items() if pid is not None}
            export_pid = pids.get("gateway")
            if export_pid is not None and (exporting := _rss_mib(export_pid, span_export=True)):
                rss["its span export process"] = exporting
            return results, _spans_received(sink_port), rss
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=10)


# The batch span processor exports every few seconds: wait for its last batch before counting.
_EXPORT_WAIT_S = 6.0


def _telemetry_env(traces: bool, sink_port: int) -> dict[str, str]:
    """Spans exported over OTLP/HTTP to the benchmark's sink, as a production gateway would to a collector."""
    if not traces:
        return {"AGENT_GATEWAY_TRACES": "none"}
    return {"AGENT_GATEWAY_TRACES": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces"}


def _rss_mib(pid: int, span_export: bool | None = None) -> float:
    """A process's resident memory, with its descendants' (--workers N forks them; each has a span export
    process), in MiB; only the span export processes' (True) or all but theirs (False)."""
    total = 0.0
    for each in (pid, *_children(pid)):
        if span_export is not None and _is_span_export(each) != span_export:
            continue
        try:
            lines = Path(f"/proc/{each}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:"))
    return total


def _spans_received(sink_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{sink_port}/count", timeout=5) as reply:
        return int(json.load(reply)["spans"])


def median(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def report(results: Results, spans: int, rss: dict[str, float]) -> None:
    print(f"{'scenario':24} {'target':14} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'x direct':>9} "
          f"{'x minimal':>9} {'+p50 ms':>8} {'cpu us/req':>10} {'errors':>6}")
    for scenario, by_target in results.items():
        direct_rps, minimal_rps = median(by_target["direct"], "rps"), median(by_target["minimal proxy"], "rps")
        direct_p50 = median(by_target["direct"], "p50_ms")
        for target, samples in by_target.items():
            rps, p50 = median(samples, "rps"), median(samples, "p50_ms")
            print(f"{scenario:24} {target:14} {rps:8.0f} {p50:8.2f} {median(samples, 'p99_ms'):8.2f} "
                  f"{rps / direct_rps:9.2f} {rps / minimal_rps:9.2f} {p50 - direct_p50:8.2f} "
                  f"{median(samples, 'cpu_us_per_req'):10.0f} "
                  f"{sum(int(s['errors']) for s in samples):6d}")
    gateway_requests = sum(int(s["requests"]) for by_target in results.values()
                           for target, samples in by_target.items() if target.startswith("g") for s in samples)
    print(f"\nspans the gateways exported over OTLP: {spans} for {gateway_requests} requests")
    for scenario, by_target in results.items():
        if "score_us_per_req" in by_target["gateway"][0]:
            score, cpu = median(by_target["gateway"], "score_us_per_req"), median(by_target["gateway"],
                                                                                  "cpu_us_per_req")
            print(f"{scenario}: the classifier, timed in the gateway: {score:.1f} µs per request, "
                  f"{score / cpu:.1%} of its CPU per request ({cpu:.0f} µs; target <= 10%)")
        if NO_SCORE in by_target:
            with_score, without = median(by_target["gateway"], "cpu_us_per_req"), median(by_target[NO_SCORE],
                                                                                         "cpu_us_per_req")
            print(f"{scenario}: the classifier's share, A/B against the gateway without it: "
                  f"{(with_score - without) / with_score:.1%} ({with_score:.0f} vs {without:.0f} µs; target <= 10%)")
    if "non-stream c=32" not in results:
        agent_report(results, rss)
    if "non-stream c=32" not in results or "open loop 400 req/s" not in results:
        return
    c32 = results["non-stream c=32"]
    ratio = median(c32["gateway"], "rps") / median(c32["minimal proxy"], "rps")
    open_ = results["open loop 400 req/s"]
    added = {t: median(open_[t], "p50_ms") - median(open_["direct"], "p50_ms") for t in TARGETS}
    print(f"\ngateway req/s vs minimal proxy at c=32: {ratio:.2f}x (target >= 0.70, issue 36)")
    if "non-stream c=1" in results:
        c1 = results["non-stream c=1"]
        over = median(c1["gateway"], "p50_ms") - median(c1["minimal proxy"], "p50_ms")
        print(f"non-stream c=1: gateway p50 over the minimal proxy's {over:.2f} ms (target <= 0.15, issue 36)")
    print("RSS after the run: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in rss.items())
          + " (target: gateway <= 120 MiB)")
    print(f"added p50 at 400 req/s: gateway {added['gateway']:.2f} ms, minimal proxy {added['minimal proxy']:.2f} ms "
          f"(target: gateway <= 2x minimal = {2 * added['minimal proxy']:.2f} ms)")


def agent_report(results: Results, rss: dict[str, float]) -> None:
    """The figures issue 36 budgets coding agents' steps by (--body agent-*)."""
    for scenario in ("non-stream c=8", "stream 64 chunks c=8"):
        if scenario in results:
            by_target = results[scenario]
            ratio = median(by_target["gateway"], "rps") / median(by_target["minimal proxy"], "rps")
            print(f"{scenario}: gateway req/s vs minimal proxy {ratio:.2f}x (target >= 0.6), CPU "
                  f"{median(by_target['gateway'], 'cpu_us_per_req'):.0f} µs a request (target <= 600), minimal "
                  f"proxy {median(by_target['minimal proxy'], 'cpu_us_per_req'):.0f}")
    if "non-stream c=1" in results:
        c1 = results["non-stream c=1"]
        print(f"non-stream c=1: gateway p99 over direct "
              f"{median(c1['gateway'], 'p99_ms') - median(c1['direct'], 'p99_ms'):.2f} ms (target <= 2)")
    print("RSS after the run: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in rss.items())
          + " (target: gateway <= 120 MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml",
                        help="gateway policy (its deployment URLs are pointed at the fake upstream)")
    parser.add_argument("--without-classifier", action="store_true",
                        help="also run the gateway with the policy's score rules dropped (interleaved), "
                             "and print the classifier's share of the CPU per request")
    parser.add_argument("--no-traces", action="store_true",
                        help="run the gateway without exporting spans (metrics only)")
    parser.add_argument("--only", help="run only the scenarios whose name has these words, e.g. c=32 or 'open loop'")
    parser.add_argument("--sessions", type=int, default=0,
                        help="calls name one of this many agent sessions (x-session-id): each is a recorded step")
    parser.add_argument("--body", default="chat", choices=("chat", *agent_bodies.KINDS),
                        help="small chats (the default scenarios), or coding agents' steps of about that size, "
                             "each naming its session (scenarios at c=8 and c=1)")
    args = parser.parse_args()
    report(*run(args.rounds, args.duration_s, args.workers, args.policy, args.without_classifier, args.only,
                not args.no_traces, args.sessions, args.body))


if __name__ == "__main__":
    main()
