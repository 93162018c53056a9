"""TTFT of the step that moves an agent session to hq, with and without the warm-up, on a caching fake pair.

    python -m bench.warmup_bench [--tool-s 1.0] [--output-tokens 2000] [--steps 8]

Two fake deployments that cache as vLLM's prefix cache does when nothing is evicted (each holds every prompt it
read; a prompt's cached part is the longest run of leading messages it shares with one of them) and wait, before
their first byte, the prefill of the rest: `prefill_ms_per_1k_tokens` of default.yaml's switch section (hq 100,
fast 60), about four characters a token. The gateway runs in this process with default.yaml's rules. One session:
a task, then each step a tool call whose output is `--output-tokens` long; the tools of steps 5 and 6 fail (the
rules want hq), and between steps the agent's tool runs `--tool-s` seconds. Printed per routing: where each
step went and its TTFT, and the TTFT of the first step served by hq after the session settled on fast.

    rules alone           no switch section: step 5 moves to hq and prefills what hq has not seen
    switch, no warm-up    step 5 and 6 stay on fast (hq would prefill too much for their rule's worth)
    switch + warm-up      step 5 stays and warms hq while its tool runs; step 6 moves, hq lacks one output
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from gateway.server.app import create_app
from gateway.server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
PREFILL_MS_PER_1K = DEFAULT["switch"]["prefill_ms_per_1k_tokens"]
CHARS_PER_TOKEN = 4
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
FAILING = (5, 6)


def tokens_of(piece: Any) -> int:
    return max(1, len(json.dumps(piece)) // CHARS_PER_TOKEN)


class CachingFake:
    """A deployment whose TTFT is the prefill of the prompt's uncached tokens."""

    def __init__(self, name: str, prefill_ms_per_1k: float) -> None:
        self.name, self.prefill_ms_per_1k = name, prefill_ms_per_1k
        self.seen: list[list[str]] = []  # every prompt read, as its pieces' JSON

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f'vllm:num_requests_waiting{{model_name="{self.name}"}} 0\n'
                                 f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} 0.1\n')

    def _prefill(self, body: dict[str, Any]) -> tuple[int, int]:
        pieces = [json.dumps(body.get("tools"))] + [json.dumps(m, sort_keys=True) for m in body["messages"]]
        shared = max((_leading(pieces, seen) for seen in self.seen), default=0)
        self.seen.append(pieces)
        total = sum(len(p) for p in pieces) // CHARS_PER_TOKEN
        return total, sum(len(p) for p in pieces[:shared]) // CHARS_PER_TOKEN

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        total, cached = self._prefill(body)
        await asyncio.sleep((total - cached) * self.prefill_ms_per_1k / 1e6)
        usage = {"prompt_tokens": total, "completion_tokens": 1, "total_tokens": total + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        n = len([m for m in body["messages"] if m["role"] == "assistant"]) + 1
        call = {"index": 0, "id": f"c{n}", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"n": n})}}
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "chat.completion", "model": self.name, "usage": usage,
                                      "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                                          "role": "assistant", "content": None, "tool_calls": [call]}}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                      {"choices": [], "usage": usage}):
            await response.write(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                                         "model": self.name, **chunk}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


def _leading(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def policy(hq: str, fast: str, switch: dict[str, Any] | None) -> dict[str, Any]:
    def deployment(url: str, model: str) -> dict[str, Any]:
        return {"url": url, "served_model": model, "timeouts": {"connect_s": 1, "read_s": 30, "total_s": 60},
                "health": {"interval_s": 0.5, "timeout_s": 1}, "load": {"scrape_interval_s": 0.2}}
    out = {"version": 1, "deployments": {"hq": deployment(hq, "hq"), "fast": deployment(fast, "fast")},
           "models": {"auto": {"route": "rules"}}, "rules": DEFAULT["rules"], "default": "fast",
           "fallback": ["fast", "hq"]}
    if switch is not None:
        out["switch"] = switch
    return out


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def session(url: str, steps: int, output_tokens: int, tool_s: float) -> list[tuple[str, float]]:
    """(deployment, TTFT ms) of each step of one session through the gateway at `url`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test in parser.py."}]
    out = []
    async with aiohttp.ClientSession() as http:
        for n in range(steps):
            if n:
                await asyncio.sleep(tool_s)  # the agent's tool runs
                code = int(n in FAILING)
                output = "x" * (output_tokens * CHARS_PER_TOKEN) + f"\n[Command finished with exit code {code}]"
                messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{n}", "type": "function",
                             "function": {"name": "bash", "arguments": json.dumps({"n": n})}}]},
                             {"role": "tool", "tool_call_id": f"c{n}", "content": output}]
            started = time.perf_counter()
            async with http.post(f"{url}/v1/chat/completions", headers={"x-session-id": "bench"}, json={
                    "model": "auto", "messages": messages, "tools": TOOLS, "stream": True}) as resp:
                await resp.content.readany()
                ttft_ms = (time.perf_counter() - started) * 1000
                await resp.read()
                out.append((resp.headers["x-gateway-deployment"], ttft_ms))
    return out


async def run(name: str, switch: dict[str, Any] | None, args: argparse.Namespace, tmp: Path) -> list[tuple[str, float]]:
    hq, fast = CachingFake("hq", PREFILL_MS_PER_1K["hq"]), CachingFake("fast", PREFILL_MS_PER_1K["fast"])
    runners = []
    hq_runner, hq_url = await serve(hq.app())
    fast_runner, fast_url = await serve(fast.app())
    runners += [hq_runner, fast_runner]
    path = tmp / f"{name.replace(' ', '-').replace(',', '')}.yaml"
    path.write_text(yaml.safe_dump(policy(hq_url, fast_url, switch)))
    gateway_runner, gateway_url = await serve(create_app(Settings(policy=str(path))))
    runners.append(gateway_runner)
    try:
        await asyncio.sleep(0.5)  # the first health checks and load scrapes
        return await session(gateway_url, args.steps, args.output_tokens, args.tool_s)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def first_move_to_hq(steps: list[tuple[str, float]]) -> tuple[int, float] | None:
    """The first step on hq after the session settled on fast."""
    settled = False
    for n, (deployment, ttft_ms) in enumerate(steps):
        settled = settled or deployment == "fast"
        if settled and deployment == "hq":
            return n, ttft_ms
    return None


async def main_async(args: argparse.Namespace) -> None:
    no_warm = {k: v for k, v in DEFAULT["switch"].items() if k != "warm"}
    routings = [("rules alone", None), ("switch, no warm-up", no_warm), ("switch + warm-up", DEFAULT["switch"])]
    print(f"one session, {args.steps} steps, {args.output_tokens:,}-token tool outputs, tools {args.tool_s:g} s; "
          f"prefill ms/1k tokens: {PREFILL_MS_PER_1K}; steps {FAILING} fail")
    print(f"{'routing':22} {'steps (deployment TTFT ms)':<100} {'move to hq: step, TTFT':>24} {'TTFT sum':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, switch in routings:
            steps = await run(name, switch, args, Path(tmp))
            moved = first_move_to_hq(steps)
            said = f"step {moved[0]}, {moved[1]:,.0f} ms" if moved else "never"
            shown = " ".join(f"{d[0]}{ttft:.0f}" for d, ttft in steps)
            print(f"{name:22} {shown:<100} {said:>24} {sum(t for _, t in steps):>7,.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=2000)
    parser.add_argument("--tool-s", type=float, default=1.0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
