"""A coding agent's session replayed on `up`'s real vLLM pair: time to first token and prefix-cache hits per routing.

    .venv/bin/python -m bench.session_replay_up [--steps 10] [--output-chars 1500]

Starts the CPU pair as `agent-gateway up` does (the tiny model, prefix caching, cached-token details) and two
gateways in front of it: `before`, the default policy without its `switch` section (rules alone), and `after`,
the default policy. One session of `--steps` steps, as Codex sends them through Chat Completions: a coding agent's
system prompt and eight tools (bench/agent_bodies.py), a task, then each step one more shell call and its real
output from this repository (git log, sed, grep, ls; two of them fail with a pytest failure and its
`Exit code: 1`, which the default rules send to hq). Each routing replays the session under its own session id with
its own first line, so no routing finds another's prompt cached:

    before    model auto through the rules alone
    after     model auto with the switch price (and warm-ups)
    hq, fast  pinned, through the `after` gateway

Printed per routing: where each step went and its time to first token (streamed), the sum, and each deployment's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` over the routing's steps (tokens). The tool's
time between steps is `--tool-s` (warm-ups run in it). Every process is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench import agent_bodies
from serving import profile as profiles
from serving.launcher import ServerCommand, free_port, running, stop_groups
from serving.up import fill_policy, prepare, start_gateway, wait_listening

ROOT = Path(__file__).resolve().parent.parent
# The shell commands whose real output the session reads, in order; None: a failing pytest run (exit code 1).
COMMANDS: tuple[str | None, ...] = (
    "git log --oneline -n 30", "ls gateway gateway/decision", "sed -n 1,60p gateway/decision/routing.py",
    "grep -rn 'def decide' gateway", None, "sed -n 1,50p gateway/decision/switch.py",
    "grep -rn 'prefill_ms_per_1k_tokens' gateway policies", None, "sed -n 60,120p gateway/decision/routing.py",
    "git log --stat -n 3", "sed -n 1,40p gateway/server/warmups.py", "ls tests/decision",
)
FAILING = """============================= test session starts ==============================
collected 26 items

tests/decision/test_windows.py ........................F.                  [100%]

=================================== FAILURES ===================================
___________ test_an_agents_own_compaction_request_goes_to_the_largest_window ___________
    def test_an_agents_own_compaction_request_goes_to_the_largest_window():
>       assert asked.deployment == "hq"
E       AssertionError: assert 'fast' == 'hq'
=========================== short test summary info ============================
FAILED tests/decision/test_windows.py::test_an_agents_own_compaction_request_goes_to_the_largest_window
========================= 1 failed, 25 passed in 1.31s =========================
"""
ROUTINGS = ("before", "after", "hq", "fast")


def shell_output(command: str | None, limit: int) -> tuple[str, int]:
    """A command's real output in this repository (its first `limit` characters) and its exit code."""
    if command is None:
        return FAILING, 1
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    return (done.stdout + done.stderr)[:limit], done.returncode


def commands(failing_twice: bool) -> tuple[str | None, ...]:
    """The session's shell commands; failing twice: each failing pytest run is run again and fails again (the
    agent's first fix did not work), so the step after the first failure has a reason to go to hq too."""
    if not failing_twice:
        return COMMANDS
    return tuple(c for command in COMMANDS for c in ((command,) if command is not None else (None, None)))


def tool_times(steps: int, failing_twice: bool, tool_s: float, pytest_s: float) -> list[float]:
    """The agent's tool time after each step: the next command's run (a pytest run takes `pytest_s`)."""
    run = commands(failing_twice)
    return [pytest_s if run[(n + 1) % len(run)] is None else tool_s for n in range(steps)]


def session(steps: int, output_chars: int, first_line: str, failing_twice: bool = False) -> list[list[dict[str, Any]]]:
    """Each step's messages: the system prompt and task, then one more shell call and its result per step."""
    run = commands(failing_twice)
    rng = random.Random(7)
    system = first_line + "\n" + agent_bodies.system_prompt(rng, 6_000)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": "Find why agent compaction requests are not "
                                                                  "routed to the largest window, and fix it."}]
    out = []
    for n in range(steps):
        command = run[n % len(run)]
        text, code = shell_output(command, output_chars)
        call_id = f"call_{n}"
        arguments = json.dumps({"command": ["bash", "-lc", command or "pytest -q tests/decision"]})
        messages = [*messages,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": f"Exit code: {code}\nOutput:\n{text}"}]
        out.append(messages)
    return out


def tools() -> list[dict[str, Any]]:
    return agent_bodies.tools(random.Random(7))[:8]


def step(base: str, model: str, session_id: str, messages: list[dict[str, Any]]) -> tuple[str, float]:
    """One streamed step: the deployment that served it and its time to first token (s)."""
    body = json.dumps({"model": model, "messages": messages, "tools": tools(), "max_tokens": 16, "stream": True,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "x-session-id": session_id})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as resp:
        deployment = resp.headers.get("x-gateway-deployment", "?")
        first = None
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - started
        return deployment, first if first is not None else time.monotonic() - started


def cache_counters(commands: Mapping[str, ServerCommand]) -> dict[str, tuple[float, float]]:
    """Each deployment's prefix-cache (hits, queries) in tokens, from vLLM's /metrics."""
    found = {}
    for name, command in commands.items():
        with urllib.request.urlopen(f"http://{command.host}:{command.port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        found[name] = (_total(text, "vllm:prefix_cache_hits_total"), _total(text, "vllm:prefix_cache_queries_total"))
    return found


def _total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def warmups(base: str) -> dict[str, float]:
    """The gateway's warm-ups so far, by deployment and how each ended (or why none started)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("gateway_cache_warmups_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            found[f"{labels['deployment'].strip(chr(34))} {labels['outcome'].strip(chr(34))}"] = float(line.split()[-1])
    return found


def replay(base: str, model: str, routing: str, steps: list[list[dict[str, Any]]], tool_s: list[float],
           commands: Mapping[str, ServerCommand]) -> dict[str, Any]:
    before, warm_before = cache_counters(commands), warmups(base)
    served = []
    for messages, tool_time in zip(steps, tool_s, strict=True):
        served.append(step(base, model, f"replay-{routing}", messages))
        time.sleep(tool_time)  # the agent's tool runs: a warm-up, when the policy starts one, runs meanwhile
    after, warm_after = cache_counters(commands), warmups(base)
    hits = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in commands}
    warmed = {k: v - warm_before.get(k, 0) for k, v in warm_after.items() if v > warm_before.get(k, 0)}
    return {"routing": routing, "steps": served, "ttft_sum_s": sum(t for _, t in served), "prefix_cache": hits,
            "warmups": warmed}


def render(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'routing':8} {'steps (deployment initial, TTFT ms)':<90} {'TTFT sum':>9}  prefix cache hits / queries"
             "  warm-ups"]
    for row in rows:
        steps = " ".join(f"{d[0]}{t * 1000:.0f}" for d, t in row["steps"])
        cache = ", ".join(f"{n} {h:,.0f} / {q:,.0f}" for n, (h, q) in row["prefix_cache"].items())
        warmed = ", ".join(f"{k} {v:.0f}" for k, v in row["warmups"].items()) or "none"
        lines.append(f"{row['routing']:8} {steps:<90} {row['ttft_sum_s'] * 1000:>7.0f} ms  {cache}  {warmed}")
    return "\n".join(lines)


@contextmanager
def gateways(commands: Mapping[str, ServerCommand], folder: Path) -> Iterator[dict[str, str]]:
    """The `before` and `after` gateways in front of the pair: their base URLs."""
    default = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    before = {k: v for k, v in default.items() if k != "switch"}
    started, urls = [], {}
    try:
        for name, policy in (("before", before), ("after", default)):
            path, port = folder / f"{name}.yaml", free_port()
            path.write_text(yaml.safe_dump(fill_policy(policy, commands), sort_keys=False))
            process = start_gateway(path, "127.0.0.1", port, folder / f"{name}.log")
            started.append(process)
            wait_listening(process, "127.0.0.1", port, 120.0, folder / f"{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls
    finally:
        stop_groups(started, grace_s=10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-chars", type=int, default=1_500, help="each tool output's characters at most")
    parser.add_argument("--tool-s", type=float, default=1.0, help="the agent's tool time between steps")
    parser.add_argument("--routings", default=",".join(ROUTINGS), help=f"of {', '.join(ROUTINGS)}")
    parser.add_argument("--failing-twice", action="store_true",
                        help="each failing pytest run fails again at the next step (a warm-up has a step to pay off)")
    parser.add_argument("--pytest-s", type=float, default=None,
                        help="the tool time before a pytest result (default --tool-s): time for a warm-up to finish")
    args = parser.parse_args()
    profile = profiles.load("cpu")
    with tempfile.TemporaryDirectory(prefix="replay-up-") as tmp:
        folder = Path(tmp)
        commands = prepare(profile, None)
        with running(commands, folder, start=profile.start, timeout_s=profile.startup_timeout_s,
                     progress=lambda m: print(m, file=sys.stderr)), gateways(commands, folder) as urls:
            rows = []
            for routing in args.routings.split(","):
                model = "auto" if routing in ("before", "after") else routing
                base = urls["before" if routing == "before" else "after"]
                steps = session(args.steps, args.output_chars, f"# run {routing}", args.failing_twice)
                waits = tool_times(args.steps, args.failing_twice, args.tool_s,
                                   args.tool_s if args.pytest_s is None else args.pytest_s)
                rows.append(replay(base, model, routing, steps, waits, commands))
                print(f"{routing} done", file=sys.stderr)
    print(render(rows))


if __name__ == "__main__":
    main()
