"""A fast fake OpenAI upstream for benchmarks: fixed answers, optional 64-chunk streams, no model.

    python -m bench.fake_upstream PORT [DELAY_MS]
"""

from __future__ import annotations

import asyncio
import json
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


DELAY_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0  # optional: a model's time per answer


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    if not body.get("stream"):
        return web.Response(body=COMPLETION, content_type="application/json")
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(STREAM_CHUNKS):
        await response.write(CHUNK)
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(USAGE)
    await response.write(b"data: [DONE]\n\n")
    return response


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="")


def main() -> None:
    import uvloop

    uvloop.install()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
