"""Benchmark: instructions per request of the gateway and the minimal proxy, counted by callgrind, one run.

    .venv/bin/python -m bench.instructions [--requests 1000] [--warmup 300] [--concurrency 8] [--no-spans-off]
                                           [--body agent-100k [--stream]]

Wall-clock figures on a shared 2-core VM move by ±10% between runs of the same code; instructions do not
depend on the load, so they are the measure of a change on the request path. Each proxy runs under
`valgrind --tool=callgrind` in front of `fakes.openai_upstream` (spans to `fakes.trace_sink`, the default
policy); its counters are zeroed after the warm-up requests and dumped after the measured ones, and the
count is the process's user-space instructions divided by the requests. Work done per second rather than per
request would make the count depend on the pace callgrind ran at (and so on the machine's load): health
probes are spaced out past the run, and spans are posted in whole batches of 512, as at full load, not every
2 s. Prints each target's figure and the gateway's ratio to the minimal proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.proxy_bench import PY, ROOT, _telemetry_env, free_port, gateway_policy, start, wait_ready

# Under valgrind a process runs ~50x slower: it needs longer to start listening.
READY_S = 180.0
HEALTH_INTERVAL_S = 3600  # one probe per deployment at the start, none while counting
# Only whole batches are posted, as at full load; at callgrind's pace a 2 s batch holds ~60 spans, each post shared
# by fewer requests. Batches of 512 (the gateway's default is 2,048) so that the counted requests' spans are posted:
# the encoding, per span, is most of an export's cost either way.
SPANS_BATCHED = {"OTEL_BSP_SCHEDULE_DELAY": str(3600 * 1000), "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512"}


def _loadgen(url: str, requests: int, concurrency: int, load: tuple[str, ...] = ()) -> int:
    """Run `requests` calls at `concurrency` (`load`: the body and stream options); how many the proxy served (the
    warm-up call too)."""
    out = subprocess.run([PY, "-m", "bench.loadgen", "--url", url, "--concurrency", str(concurrency),
                          "--duration-s", "3600", "--max-requests", str(requests), *load],
                         cwd=ROOT, capture_output=True, text=True, timeout=3600, check=True)
    figures = json.loads(out.stdout)
    if figures["errors"]:
        raise SystemExit(f"{url}: {figures['errors']} of {figures['requests']} requests failed")
    return int(figures["requests"]) + 1


def _dumped_instructions(out_dir: Path, before: set[Path]) -> int:
    """The `summary:` of the dump callgrind_control -d just wrote (the instructions since the last zeroing)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for dump in set(out_dir.glob("callgrind.out.*")) - before:
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise SystemExit(f"callgrind wrote no dump in {out_dir}")


def count(name: str, argv: list[str], port: int, env: dict[str, str], requests: int, warmup: int,
          concurrency: int, out_dir: Path, load: tuple[str, ...] = ()) -> float:
    """Instructions per request of one proxy under callgrind."""
    out_dir.mkdir()
    proc = start(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/callgrind.out.%p",
                  *argv], env=env)
    try:
        wait_ready(port, READY_S)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        _loadgen(url, warmup, concurrency, load)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        served = _loadgen(url, requests, concurrency, load)
        before = set(out_dir.glob("callgrind.out.*"))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        per_request = _dumped_instructions(out_dir, before) / served
        print(f"{name:24} {per_request:12,.0f} instructions per request ({served} requests)", flush=True)
        return per_request
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml")
    parser.add_argument("--no-spans-off", action="store_true", help="skip the gateway with spans off")
    parser.add_argument("--keep", type=Path, help="keep each target's callgrind dump under this new folder "
                                                   "(for callgrind_annotate)")
    parser.add_argument("--body", default="chat", help="chat (small), or agent-100k / agent-180k: coding agents' "
                                                         "steps (bench/agent_bodies.py)")
    parser.add_argument("--stream", action="store_true", help="streamed calls")
    args = parser.parse_args()
    load = ("--body", args.body, *(["--stream"] if args.stream else []))
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        dumps = args.keep or Path(tmp)
        dumps.mkdir(parents=True, exist_ok=True)
        try:
            up_port, sink_port = free_port(), free_port()
            upstream = f"http://127.0.0.1:{up_port}"
            procs.append(start([PY, "-m", "fakes.openai_upstream", str(up_port)]))
            procs.append(start([PY, "-m", "fakes.trace_sink", str(sink_port)]))
            wait_ready(up_port)
            wait_ready(sink_port)
            policy = gateway_policy(upstream, tmp, args.policy, False, "instructions",
                                    health_interval_s=HEALTH_INTERVAL_S)
            targets = [("minimal proxy", ["-m", "bench.minimal_proxy", "{port}", upstream], {}),
                       ("gateway (spans on)", ["-m", "gateway", "serve", "--policy", policy, "--port", "{port}"],
                        {**_telemetry_env(True, sink_port), **SPANS_BATCHED})]
            if not args.no_spans_off:
                targets.append(("gateway (spans off)", targets[1][1], _telemetry_env(False, sink_port)))
            figures = {}
            for i, (name, argv, env) in enumerate(targets):
                port = free_port()
                figures[name] = count(name, [PY, *(a.format(port=port) for a in argv)], port,
                                      {"AGENT_GATEWAY_LOG_LEVEL": "WARNING", **env}, args.requests, args.warmup,
                                      args.concurrency, dumps / f"target-{i}", load)
            minimal = figures["minimal proxy"]
            for name, per_request in figures.items():
                if name != "minimal proxy":
                    print(f"{name}: {per_request / minimal:.2f}x the minimal proxy's instructions "
                          f"(+{per_request - minimal:,.0f}; target ~1.3x)")
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=10)


if __name__ == "__main__":
    main()
