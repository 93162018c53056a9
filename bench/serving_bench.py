"""Benchmark: TTFT, output tokens/s and speculation acceptance of the hq and fast deployments `up` starts.

    .venv/bin/python -m bench.serving_bench [--profile cpu] [--rounds 3] [--max-tokens 128]

Starts the profile's pair exactly as `up` does (the tiny model from its cache, free ports), streams
agent-step requests at concurrency 1 and 8 directly to each deployment, alternating deployments round by
round so drift in the machine's load hits both alike, and prints one table. The acceptance rate is read
from vLLM's own counters (`vllm:spec_decode_num_*_tokens_total`) before and after each measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from serving import profile as profiles
from serving.launcher import ServerCommand, running
from serving.up import prepare

# A typical agent step: a system prompt, a file or tool result in context, an instruction about it.
SOURCE = '''def load_config(path: str) -> dict:
    """Read the YAML config at path and return it as a dict."""
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    return data
'''
TOOL_RESULT = json.dumps(
    {"city": "Paris", "temperature_c": 18, "conditions": "light rain", "wind_kmh": 12, "humidity_pct": 81}
)
SYSTEM = "You are a careful coding agent. Answer with the change only."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
# Request bodies minus model and sampling: an edit of a file in context, a tool result to answer from, a
# file to extend.
STEPS: tuple[dict[str, Any], ...] = (
    {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Here is config.py:\n{SOURCE}\nRename load_config to read_config."}]},
    {"tools": [WEATHER], "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}]},
    {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Add a docstring example to this function:\n{SOURCE}"}]},
)  # fmt: skip
SPEC_SERIES = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    ttft_s: float
    total_s: float
    output_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first, per second after the first (the deployment's decode speed)."""
        return (self.output_tokens - 1) / max(self.total_s - self.ttft_s, 1e-9)


@dataclass
class Run:
    """Every request of one deployment at one concurrency, over all rounds."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    spec: dict[str, float] = field(default_factory=dict)

    def add_spec(self, before: dict[str, float], after: dict[str, float]) -> None:
        for key in SPEC_SERIES:
            self.spec[key] = self.spec.get(key, 0.0) + after.get(key, 0.0) - before.get(key, 0.0)

    @property
    def aggregate_tokens_per_s(self) -> float:
        return sum(s.output_tokens for s in self.samples) / max(self.wall_s, 1e-9)

    @property
    def acceptance(self) -> float | None:
        drafted = self.spec.get("draft_tokens", 0.0)
        return self.spec["accepted_tokens"] / drafted if drafted else None


@dataclass(frozen=True)
class Load:
    """What each request asks for."""

    max_tokens: int
    temperature: float


async def stream_once(
    session: aiohttp.ClientSession, url: str, model: str, step: dict[str, Any], load: Load
) -> Sample:
    body = {
        **step,
        "model": model,
        "max_tokens": load.max_tokens,
        "temperature": load.temperature,
        "ignore_eos": True,  # every request decodes max_tokens, so the deployments do equal work
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            # vLLM sends its first event (the role) once the first token exists; content may lag behind
            # it while a multi-byte character is incomplete.
            if first is None and chunk["choices"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ended = time.perf_counter()
    return Sample((first or ended) - started, ended - started, tokens)


async def measure(
    session: aiohttp.ClientSession, cmd: ServerCommand, concurrency: int, requests: int, load: Load, run: Run
) -> None:
    """`requests` streamed agent steps at `concurrency` (closed loop), added to run."""
    queue = list(range(requests))
    before = spec_counts(cmd.url)
    started = time.perf_counter()

    async def worker() -> None:
        while queue:
            i = queue.pop()
            run.samples.append(await stream_once(session, cmd.url, cmd.served_model, STEPS[i % len(STEPS)], load))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall_s += time.perf_counter() - started
    run.add_spec(before, spec_counts(cmd.url))


def spec_counts(url: str) -> dict[str, float]:
    """vLLM's cumulative speculative-decoding counters (empty when the deployment does not speculate)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for key, series in SPEC_SERIES.items():
            if line.startswith(series + "{") or line.startswith(series + " "):
                found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def bench(
    commands: dict[str, ServerCommand], concurrencies: Sequence[int], rounds: int, load: Load
) -> dict[tuple[str, int], Run]:
    runs = {(name, c): Run() for name in commands for c in concurrencies}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64)) as session:
        for cmd in commands.values():  # warm: connections, compiled paths, the prefix cache of each step
            for steps in range(len(STEPS)):
                await stream_once(session, cmd.url, cmd.served_model, STEPS[steps], load)
        for round_ in range(rounds):
            order = list(commands) if round_ % 2 == 0 else list(commands)[::-1]
            for c in concurrencies:
                for name in order:
                    # At concurrency c, 2c requests per round: each slot is busy twice.
                    await measure(session, commands[name], c, 2 * max(c, 2), load, runs[name, c])
    return runs


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(runs: dict[tuple[str, int], Run], concurrencies: Sequence[int], load: Load) -> None:
    print(f"streamed agent steps, {load.max_tokens} output tokens each (temperature {load.temperature:g}, "
          "ignore_eos), direct to each vLLM")
    header = (f"{'deployment':10s} {'conc':>4s} {'n':>4s} {'TTFT p50 ms':>11s} {'TTFT p90 ms':>11s} "
              f"{'decode tok/s p50':>16s} {'tok/s total':>11s} {'step p50 ms':>11s} {'accepted':>9s}")
    print(header)
    for c in concurrencies:
        for name in ("hq", "fast"):
            run = runs[name, c]
            ttft = [s.ttft_s * 1000 for s in run.samples]
            rate = [s.decode_tokens_per_s for s in run.samples]
            total = [s.total_s * 1000 for s in run.samples]
            accepted = "-" if run.acceptance is None else f"{run.acceptance:.0%}"
            print(f"{name:10s} {c:4d} {len(run.samples):4d} {statistics.median(ttft):11.1f} {pct(ttft, 0.9):11.1f} "
                  f"{statistics.median(rate):16.1f} {run.aggregate_tokens_per_s:11.1f} "
                  f"{statistics.median(total):11.1f} {accepted:>9s}")
        hq, fast = runs["hq", c], runs["fast", c]
        per_request = statistics.median(s.decode_tokens_per_s for s in fast.samples) / statistics.median(
            s.decode_tokens_per_s for s in hq.samples)
        step = statistics.median(s.total_s for s in hq.samples) / statistics.median(
            s.total_s for s in fast.samples)
        print(f"{'fast/hq':10s} {c:4d} {'':4s} {'':11s} {'':11s} {per_request:12.2f}x "
              f"{fast.aggregate_tokens_per_s / hq.aggregate_tokens_per_s:10.2f}x {step:10.2f}x")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="cpu", help="cpu or a profile YAML file (default: cpu)")
    parser.add_argument("--model-dir", type=Path, help="tiny model cache (default: the one `up` uses)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency (default 3)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0, as agents' tool steps use")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    profile = profiles.load(args.profile)
    started = time.monotonic()
    commands = prepare(profile, args.model_dir)
    with (
        tempfile.TemporaryDirectory(prefix="serving-bench-") as work,
        running(commands, Path(work), start=profile.start, timeout_s=profile.startup_timeout_s, progress=say),
    ):
        say(f"pair ready in {time.monotonic() - started:.0f} s (model build included)")
        load = Load(args.max_tokens, args.temperature)
        runs = asyncio.run(bench(commands, args.concurrency, args.rounds, load))
    report(runs, args.concurrency, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
