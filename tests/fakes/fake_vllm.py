"""A fault-injecting fake of a vLLM OpenAI server, for what real vLLM cannot be made to do on cue.

Behaviour per request is steered by the request body's `fake` field or by the server's `faults` queue:
fail with a status, stall, drop the connection mid-stream, end a stream without [DONE].
Every received request is recorded (body and headers) so tests can check pass-through fidelity.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Fault:
    status: int | None = None  # answer with this status before any byte
    stall_s: float = 0.0  # wait this long before answering
    drop_after_chunks: int | None = None  # streaming: kill the connection after N chunks
    truncate_after_chunks: int | None = None  # streaming: end cleanly without [DONE] after N chunks


@dataclass
class FakeVLLM:
    served_model: str
    chunks: int = 8
    waiting: float = 0.0  # what /metrics reports as vllm:num_requests_waiting
    kv_cache_usage: float = 0.1
    healthy: bool = True
    faults: list[Fault] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    fail_after: int | None = None  # answer 500 to every chat request after this many

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            f'vllm:num_requests_running{{model_name="{self.served_model}"}} 1.0\n'
            f'vllm:num_requests_waiting{{model_name="{self.served_model}"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.served_model}"}} {self.kv_cache_usage}\n'
        )
        return web.Response(text=text)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.served_model, "object": "model"}]})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        usage = {"prompt_tokens": 3, "total_tokens": 3}
        return web.json_response({"object": "list", "model": body["model"], "usage": usage,
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers_seen.append(dict(request.headers))
        fault = self.faults.pop(0) if self.faults else Fault()
        if self.fail_after is not None and len(self.received) > self.fail_after:
            fault = Fault(status=500)
        if fault.stall_s:
            await asyncio.sleep(fault.stall_s)
        if fault.status is not None:
            return web.json_response({"error": {"message": "injected", "type": "server_error"}}, status=fault.status)
        if body.get("model") != self.served_model:
            return web.json_response({"error": {"message": f"model {body.get('model')} not served"}}, status=404)
        if body.get("stream"):
            return await self._stream(request, body, fault)
        return web.json_response(self._completion(body))

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        text = " ".join(["tok"] * self.chunks)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if body.get("tools"):
            tool = body["tools"][0]["function"]["name"]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": tool, "arguments": '{"city": "Paris"}'}}]}
        return {
            "id": "cmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": self.served_model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if body.get("tools") else "stop"}],
            "usage": {"prompt_tokens": 11, "completion_tokens": self.chunks, "total_tokens": 11 + self.chunks},
        }

    async def _stream(self, request: web.Request, body: dict[str, Any], fault: Fault) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.chunks):
                if fault.drop_after_chunks is not None and i == fault.drop_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if fault.truncate_after_chunks is not None and i == fault.truncate_after_chunks:
                    await response.write_eof()
                    return response
                chunk = {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": self.served_model,
                         "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0)
            final = {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": self.served_model,
                     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": self.served_model,
                         "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": self.chunks,
                                                  "total_tokens": 11 + self.chunks}}
                await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled += 1
            raise
        return response
