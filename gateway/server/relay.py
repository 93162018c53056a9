"""Forward a decided call to its deployments in failover order and relay the answer in the call's own API.

Failover happens only before the first byte reaches the client; after it, a failure becomes the API's one
error event, never a silently truncated 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway import openai
from gateway.apis.adapter import Adapter, StreamReader
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import GatewayError, UpstreamError
from gateway.policy.model import Price
from gateway.server.middleware import add_gateway_headers
from gateway.server.resources import DEPLOYMENTS, EXCHANGE, POOL, SETTINGS, TELEMETRY
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import Metrics
from gateway.upstream import forward as upstream
from gateway.upstream.deployments import Deployments

STREAM_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}


Keep = Callable[[dict[str, Any]], Awaitable[None]]


async def forward(
    request: web.Request, adapter: Adapter, call: Call, decision: Decision, caps: Mapping[str, int] | None,
    keep: Keep | None = None,
) -> web.StreamResponse:
    """Try the decision's deployments in order; fail over only before the first byte reaches the client.

    `keep` is handed the finished answer object before the client can see the answer end (the Responses API's
    stored state: a client that chains at once must find it)."""
    app, ex = request.app, request[EXCHANGE]
    pool, deployments, metrics = app[POOL], app[DEPLOYMENTS], app[TELEMETRY].metrics
    headers = upstream.forwardable(request.headers)
    headers["x-request-id"] = ex.request_id
    if ex.trace is not None:  # the deployment's spans become children of this request's span
        headers["traceparent"] = ex.trace.traceparent()
    limit = app[SETTINGS].max_upstream_body_bytes
    answer_id = adapter.new_id()
    last: GatewayError | None = None
    for name in decision.attempts:
        dep = call.policy.deployments[name]
        payload, client_wants_usage = adapter.upstream_body(call.body, dep.served_model,
                                                            caps.get(name) if caps else None)
        ex.trying(name)
        with deployments.sending(name):
            try:
                reply = await upstream.send(pool, name, dep, adapter.path, payload, headers, ex.reached)
                answer = await upstream.answer(reply, call.features.stream, limit)
            except UpstreamError as exc:
                deployments.record_failure(name)
                metrics.failovers.labels(name, exc.code or exc.error_type).inc()
                last = exc.with_traceback(None)  # kept, its traceback would tie this frame into a cycle
                continue
            except asyncio.CancelledError:
                if ex.sent:  # before that, waiting for a connection, no deployment saw the call
                    _left_while_answering(ex, metrics, name, dep.price)
                raise
            if answer is None:
                ex.answered(name, None, dep.price)  # the model it names is read from the stream's first event
                reader = adapter.stream_reader(client_wants_usage, answer_id)
                return await _relay_stream(request, adapter, deployments, metrics, reply, reader, keep)
            raw, found = answer
            ex.answered(name, found.get("model") if isinstance(found.get("model"), str) else None, dep.price)
            if reply.status == 200:
                raw, found = adapter.answer(raw, found, answer_id)
                if keep is not None:
                    await keep(found)
            return _relay_body(request, adapter, deployments, metrics, reply, raw, found)
    raise last or UpstreamError("No deployment was tried")


def _left_while_answering(ex: Exchange, metrics: Metrics, name: str, price: Price) -> None:
    """The client left while the deployment had its request: the prompt was taken in (prefill comes first)
    and is charged; what it generated before the call was cancelled cannot be told, and is not."""
    ex.answered(name, None, price)
    ex.settle(openai.Usage(ex.prompt_tokens, 0, estimated=True), metrics)


def _relay_body(
    request: web.Request, adapter: Adapter, deployments: Deployments, metrics: Metrics, reply: upstream.Reply,
    raw: bytes, found: dict[str, object],
) -> web.Response:
    ex: Exchange = request[EXCHANGE]
    if ex.tap is not None:
        ex.tap.append(raw)
    if ex.step is not None and ex.step.chunks is not None and reply.status == 200:
        # the agent step reads the tool calls out of it, later, off the request path
        view = adapter.answer_view(found)
        ex.step.raw = raw if view is None else openai.encode(view)
    if reply.status == 200:
        deployments.record_success(reply.deployment)
        ex.settle(adapter.usage_of(found), metrics)
    return web.Response(body=raw, status=reply.status, headers=upstream.reply_headers(reply))


async def _relay_stream(
    request: web.Request, adapter: Adapter, deployments: Deployments, metrics: Metrics, reply: upstream.Reply,
    reader: StreamReader, keep: Keep | None,
) -> web.StreamResponse:
    """Relay events as they arrive; learn usage; a failure after the first byte becomes one error event."""
    ex: Exchange = request[EXCHANGE]
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers=STREAM_HEADERS))
    await response.prepare(request)
    finished = False
    tap = ex.tap
    # the chat chunks of a step that offered tools, for its tool calls; the other APIs' readers rebuild them
    kept = ex.step.chunks if ex.step is not None and adapter.step_from_chunks else None
    previous = b""
    try:
        async for chunk in reply.chunks():
            if ex.first_byte_at is None:
                ex.first_byte()
                ex.response_model = openai.model_named(chunk)
            if tap is not None:
                tap.append(chunk)
            if kept is not None:
                previous = _keep_tool_calls(kept, previous, chunk)
            out = reader.feed(chunk)
            if keep is not None and reader.done:
                await _keep_final(reader, keep)
                keep = None
            if out:
                await response.write(out)
        if not reader.done:
            raise UpstreamError(f"Deployment {reply.deployment!r} ended the stream before its end",
                                code="upstream_truncated")
        finished = True
        deployments.record_success(reply.deployment)
        _hand_step_view(ex, reader)
    except GatewayError as exc:
        deployments.record_failure(reply.deployment)
        ex.failed_mid_stream(exc)
        await response.write(reader.error_event(exc))
    finally:
        # An unfinished stream (error, client gone, cancelled) must stop the deployment's generation too.
        reply.release() if finished else reply.close()
        # The deployment had the call from the stream's first byte on: a cut stream is charged its prompt.
        ex.settle(reader.usage, metrics, reader.streamed, cut=not finished)
    await response.write_eof()
    return response


async def _keep_final(reader: StreamReader, keep: Keep) -> None:
    final = getattr(reader, "final", None)
    if isinstance(final, dict):
        await keep(final)


def _hand_step_view(ex: Exchange, reader: StreamReader) -> None:
    """A finished stream of an API other than chat hands the agent step its answer as a chat completion."""
    if ex.step is not None and ex.step.chunks is not None:
        view = reader.answer_view()
        if view is not None:
            ex.step.raw = openai.encode(view)


def _keep_tool_calls(kept: list[bytes], previous: bytes, chunk: bytes) -> bytes:
    """Keep a stream's bytes from its first tool-call delta on (and the chunk before, which may hold the
    start of that event) for the agent step; returns the chunk, the next call's `previous`."""
    if kept or b'"tool_calls"' in chunk:
        if not kept and previous:
            kept.append(previous)
        kept.append(chunk)
    return chunk
