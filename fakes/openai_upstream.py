"""A fast fake OpenAI upstream for benchmarks: fixed answers, optional 64-chunk streams, no model.

For the reliability suite (bench/reliability.py), started with `--faults`, a request picks a fault with
the `x-fake-fault` header (the gateway forwards x-* headers): see FAULTS. Without `--faults` the header is
ignored and every answer is the fast, correct one (the healthy deployment to fail over to).

    python -m fakes.openai_upstream PORT [DELAY_MS] [--faults]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiohttp import web

STREAM_CHUNKS = 64
COMPLETION = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}).encode()
CHUNK = b"data: " + json.dumps({
    "id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench",
    "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}).encode() + b"\n\n"
USAGE = b"data: " + json.dumps({
    "id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench", "choices": [],
    "usage": {"prompt_tokens": 12, "completion_tokens": 64, "total_tokens": 76}}).encode() + b"\n\n"
HUGE_BYTES = 50 * 1024 * 1024
SLOW_CHUNK_S = 0.01
# Past what the kernel's socket buffers between the fake and a slow reader take in on loopback (about a
# MiB at first): what a gateway keeps of a stream it cannot pass on shows in its RSS.
BIG_STREAM_BYTES = 4 * 1024 * 1024
BIG_EVENT = b"data: " + json.dumps({
    "id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench",
    "choices": [{"index": 0, "delta": {"content": "x" * 900}, "finish_reason": None}]}).encode() + b"\n\n"

FAULTS = {
    "slow": "streams with 10 ms between chunks",
    "die-mid-stream": "streams 8 chunks, then drops the connection",
    "503": "answers 503 before any byte",
    "html": "answers 200 with an HTML page",
    "garbage": "answers 200 with 64 KiB of random bytes",
    "huge": "answers 200 with 50 MiB of random bytes (chunked)",
    "huge-json": "answers 200 with a 50 MiB body that starts like a JSON object (chunked)",
    "hold": "never answers (until the gateway gives up)",
    "big-stream": "streams 4 MiB of 1 KiB events as fast as the gateway takes them",
}


FAULTY = web.AppKey("faulty", bool)
_ARGS = [a for a in sys.argv[2:] if not a.startswith("--")]
DELAY_S = float(_ARGS[0]) / 1000 if _ARGS else 0.0  # optional: a model's time per answer


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    fault = request.headers.get("x-fake-fault", "") if request.app[FAULTY] else ""
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    if fault == "big-stream":
        return await _big_stream(request)
    if fault and fault not in ("slow", "die-mid-stream"):
        return await _fault(request, fault)
    if not body.get("stream"):
        return web.Response(body=COMPLETION, content_type="application/json")
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(STREAM_CHUNKS):
        if fault == "die-mid-stream" and i == 8:
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write(CHUNK)
        if fault == "slow":
            await asyncio.sleep(SLOW_CHUNK_S)
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(USAGE)
    await response.write(b"data: [DONE]\n\n")
    return response


async def _fault(request: web.Request, fault: str) -> web.StreamResponse:
    if fault == "503":
        return web.json_response({"error": {"message": "overloaded; internal host db-7.internal"}}, status=503)
    if fault == "html":
        return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html")
    if fault == "garbage":
        return web.Response(body=os.urandom(64 * 1024), content_type="application/json")
    if fault == "hold":
        await asyncio.sleep(3600)
    # huge, huge-json: chunked, so no Content-Length tells the gateway the size up front
    response = web.StreamResponse(headers={"content-type": "application/json"})
    await response.prepare(request)
    if fault == "huge-json":
        await response.write(b'{"id": "cmpl-bench", "padding": "')
    block = os.urandom(1024 * 1024) if fault == "huge" else b"x" * (1024 * 1024)
    for _ in range(HUGE_BYTES // len(block)):
        await response.write(block)
    await response.write_eof()
    return response


async def _big_stream(request: web.Request) -> web.StreamResponse:
    """As fast as the gateway takes it: aiohttp's write waits for the transport to drain every 64 KiB."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(BIG_STREAM_BYTES // len(BIG_EVENT)):
        await response.write(BIG_EVENT)
    await response.write(USAGE + b"data: [DONE]\n\n")
    return response


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="")


def main() -> None:
    import uvloop

    uvloop.install()
    app = web.Application(client_max_size=64 * 1024 * 1024)  # a deployment takes agents' big bodies
    app[FAULTY] = "--faults" in sys.argv[2:]
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
