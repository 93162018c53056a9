"""Time to first token of streaming chat requests, direct to vLLM versus through the gateway (median of N)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from serving import profile as profiles
from serving import tiny_model
from serving.launcher import build_commands, free_port, running, stop_groups
from serving.up import start_gateway, wait_listening, write_policy

PROMPT = [{"role": "user", "content": "Write one sentence about the old stone bridge over the river."}]


async def ttft_s(session: aiohttp.ClientSession, base_url: str, model: str, max_tokens: int) -> float:
    """Seconds from sending the request to the first SSE event; the rest of the stream is drained."""
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first = None
    async with session.post(base_url + "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in response.content.iter_any():
            if first is None and b"data:" in chunk:
                first = time.perf_counter() - started
    assert first is not None, "the stream carried no event"
    return first


async def measure(
    direct: str, gateway: str, model: str, gateway_model: str, count: int, max_tokens: int
) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(5):  # warm both paths (connections, prefix cache, the gateway's first scrape)
            await ttft_s(session, direct, model, max_tokens)
            await ttft_s(session, gateway, gateway_model, max_tokens)
        samples: dict[str, list[float]] = {"direct": [], "gateway": []}
        # Interleaved, so drift in the machine's load hits both paths alike.
        for _ in range(count):
            samples["direct"].append(await ttft_s(session, direct, model, max_tokens))
            samples["gateway"].append(await ttft_s(session, gateway, gateway_model, max_tokens))
    report(samples)


def report(samples: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    for name, values in samples.items():
        ordered = sorted(values)
        p90 = ordered[int(0.9 * (len(ordered) - 1))] * 1000
        print(f"{name:8s} n={len(values)} median TTFT {medians[name]:7.2f} ms   p90 {p90:7.2f} ms")
    added = medians["gateway"] - medians["direct"]
    ratio = medians["gateway"] / medians["direct"]
    print(f"gateway adds {added:+.2f} ms to the median TTFT ({ratio:.2f}x direct)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deployment", choices=["hq", "fast"], default="fast")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttft-")))
        profile = profiles.load("cpu")
        commands = build_commands(
            profile,
            model_dir=tiny_model.build(),
            ports={n: free_port() for n, _ in profile.deployments.items()},
        )
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        stack.enter_context(running(commands, work, timeout_s=profile.startup_timeout_s, progress=say))
        port = free_port()
        gateway = start_gateway(
            write_policy(None, commands, work / "policy.yaml"), "127.0.0.1", port, work / "gateway.log"
        )
        stack.callback(stop_groups, [gateway], 10.0)
        wait_listening(gateway, "127.0.0.1", port, 60.0, work / "gateway.log")
        target = commands[args.deployment]
        print(
            f"{args.requests} streaming requests each, max_tokens={args.max_tokens}, deployment "
            f"{args.deployment} ({target.served_model}), gateway pinned with model={args.deployment!r}"
        )
        asyncio.run(
            measure(
                target.url + "/v1",
                f"http://127.0.0.1:{port}/v1",
                target.served_model,
                args.deployment,
                args.requests,
                args.max_tokens,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
