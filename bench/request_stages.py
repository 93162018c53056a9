"""Benchmark: what the gateway's own request stages cost in-process, for a small chat call and a coding agent's step.

    .venv/bin/python -m bench.request_stages [--rounds 400]

proxy_bench measures the whole path under load with the benchmark's small prompts; an agent's step is another
shape: a 60 KB body of a long system prompt, ten tool schemas and twenty tool calls with their results. This
times each pure stage on both (median of `--rounds`, warm, one core, no I/O), against whichever checkout is on
the path, so the same command measures before and after a change. Each round decodes the body anew, as a
request does, so nothing memoized by string identity flatters the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from gateway.agents.steps import read_step
from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.routes import BY_ENDPOINT
from gateway.classifier.scoring import Classifier
from gateway.features import extract

WORDS = ("the", "function", "returns", "a", "value", "def", "class", "import", "self", "print", "error", "file",
         "path", "line", "test", "pass")


def _text(chars: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(chars // 5))


def small_chat() -> dict[str, Any]:
    """The shape of bench.loadgen's requests."""
    return {"model": "auto", "messages": [{"role": "user", "content": "Request 7: explain entropy briefly."}]}


def agent_step(calls: int = 20) -> dict[str, Any]:
    """A coding agent's step: system prompt, tool schemas, a history of tool calls and results, streamed."""
    rng = random.Random(1)
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": _text(300, rng),
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "cmd": {"type": "string"}}}}}
        for i in range(10)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(8000, rng)},
                                      {"role": "user", "content": "Fix the failing test in tests/test_x.py"}]
    for i in range(calls):
        arguments = json.dumps({"cmd": _text(80, rng)})
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "shell", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": _text(2000, rng)}]
    return {"model": "auto", "messages": messages, "tools": tools, "stream": True}


def median_us(stage: Callable[[], object], rounds: int) -> float:
    stage()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        stage()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def stages(raw: bytes, classifier: Classifier) -> dict[str, Callable[[], object]]:
    adapter = BY_ENDPOINT["chat"]
    body = adapter.parse(raw).body
    features = extract(body, "chat")
    return {
        "parse (decode + checks)": lambda: adapter.parse(raw),
        "features": lambda: extract(json_body.decode(raw), "chat"),
        "agent step": lambda: read_step(json_body.decode(raw)),
        "score": lambda: classifier.score(features),
        "upstream body": lambda: chat_wire.upstream_body(body, "served-model"),
        "(decode alone, in the two above)": lambda: json_body.decode(raw),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    classifier = Classifier.default()
    bodies = {"small chat": small_chat(), "agent step": agent_step()}
    raws = {name: json_body.encode(body) for name, body in bodies.items()}
    figures = {name: {stage: median_us(run, args.rounds) for stage, run in stages(raw, classifier).items()}
               for name, raw in raws.items()}
    names = list(bodies)
    print(f"{'stage (median µs)':34}" + "".join(f"{f'{n} ({len(raws[n]):,} B)':>24}" for n in names))
    for stage in figures[names[0]]:
        print(f"{stage:34}" + "".join(f"{figures[n][stage]:24.1f}" for n in names))


if __name__ == "__main__":
    main()
