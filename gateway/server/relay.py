"""Forward a decided call to its deployments in failover order and relay the answer in the call's own API.

Failover happens only before the first byte reaches the client; after it, a failure becomes the API's one
error event, never a silently truncated 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.apis import json_body
from gateway.apis.adapter import Adapter, StreamReader
from gateway.apis.chat import wire as chat_wire
from gateway.apis.usage import Usage
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import GatewayError, UpstreamError
from gateway.policy.model import Price
from gateway.server import resume_splice as resume
from gateway.server import resuming
from gateway.server.exchanges import add_gateway_headers
from gateway.server.resources import EXCHANGE, STATE
from gateway.telemetry.exchange import Exchange, Resume
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
    pool, deployments, metrics = app[STATE].pool, app[STATE].deployments, app[STATE].metrics
    headers = upstream.forwardable(request.headers)
    headers["x-request-id"] = ex.request_id
    if ex.trace is not None:  # the deployment's spans become children of this request's span
        ex.trace.inject(headers)
    limit = app[STATE].settings.max_upstream_body_bytes
    answer_id = adapter.new_id()
    plan = resuming.plan(adapter, call, decision, caps, answer_id, headers) if call.features.stream else None
    body = {**call.body, "return_token_ids": True} if plan is not None and plan.asks_token_ids else call.body
    last: GatewayError | None = None
    for name in decision.attempts:
        dep = call.policy.deployments[name]
        payload, client_wants_usage = adapter.upstream_body(body, dep.served_model, caps.get(name) if caps else None,
                                                            call.source)
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
                reader = adapter.stream_reader(client_wants_usage, answer_id, call.context)
                if plan is not None:
                    plan.client_wants_usage = client_wants_usage
                return await _relay_stream(request, adapter, call, decision, reply, reader, keep, plan)
            raw, found = answer
            ex.answered(name, found.get("model") if isinstance(found.get("model"), str) else None, dep.price)
            if reply.status == 200:
                raw, found = adapter.answer(raw, found, answer_id, call.context)
                if keep is not None:
                    await keep(found)
            return _relay_body(request, adapter, deployments, metrics, reply, raw, found)
    raise last or UpstreamError("No deployment was tried")


def _left_while_answering(ex: Exchange, metrics: Metrics, name: str, price: Price) -> None:
    """The client left while the deployment had its request: the prompt was taken in (prefill comes first)
    and is charged; what it generated before the call was cancelled cannot be told, and is not."""
    ex.answered(name, None, price)
    ex.settle(Usage(ex.prompt_tokens, 0, estimated=True), metrics)


def _relay_body(
    request: web.Request, adapter: Adapter, deployments: Deployments, metrics: Metrics, reply: upstream.Reply,
    raw: bytes, found: dict[str, object],
) -> web.Response:
    ex: Exchange = request[EXCHANGE]
    if reply.status >= 400:  # the deployment refused the call: its error, in the client's API's envelope
        raw = adapter.error_answer(reply.status, raw, found)
    if ex.tap is not None:
        ex.tap.append(raw)
    if ex.step is not None and ex.step.chunks is not None and reply.status == 200:
        # the agent step reads the tool calls out of it, later, off the request path
        view = adapter.answer_view(found)
        ex.step.raw = raw if view is None else json_body.encode(view)
    if reply.status == 200:
        deployments.record_success(reply.deployment)
        ex.settle(adapter.usage_of(found), metrics)
    return web.Response(body=raw, status=reply.status, headers=upstream.reply_headers(reply))


async def _relay_stream(
    request: web.Request, adapter: Adapter, call: Call, decision: Decision, reply: upstream.Reply,
    reader: StreamReader, keep: Keep | None, plan: resuming.Plan | None,
) -> web.StreamResponse:
    """Relay events as they arrive; learn usage. A failure after the first byte is resumed on the next deployment
    in the failover order where that is faithful (server/resuming.py), else it becomes one error event."""
    app, ex = request.app, request[EXCHANGE]
    state = app[STATE]
    deployments, metrics = state.deployments, state.metrics
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers=STREAM_HEADERS))
    await response.prepare(request)
    part: StreamReader | resume.Splice = reader
    transcript = plan.keep_transcript(state.transcripts, decision, reply.deployment) if plan is not None else None
    progress: resume.Progress | None = None
    finished = False
    try:
        while True:
            try:
                await _pump(response, ex, adapter, reply, part, keep, transcript, plan)
                finished = True
                deployments.record_success(reply.deployment)
                _hand_step_view(ex, part)
                break
            except GatewayError as exc:
                deployments.record_failure(reply.deployment)
                if plan is None:
                    raise
                progress = progress or _read_back(adapter, call, transcript, plan)
                if progress.finished:
                    await response.write(resuming.end_finished(request, plan, progress, reply, part))
                    finished = True
                    break
                nxt = await resuming.go_on(request, adapter, call, decision, plan, progress, reply, part, exc)
                if isinstance(nxt, Resume):
                    raise resuming.unresumed(exc, nxt) from exc
                _release(reply, progress, ex, metrics)
                reply, part = nxt
                ex.answered(reply.deployment, ex.response_model, call.policy.deployments[reply.deployment].price)
    except GatewayError as exc:
        ex.failed_mid_stream(exc)
        await response.write(resuming.error_event(reader, progress, exc))
    finally:
        # An unfinished stream (error, client gone, cancelled) must stop the deployment's generation too.
        reply.release() if finished else reply.close()
        # The deployment had the call from the stream's first byte on: a cut stream is charged its prompt.
        ex.settle(part.usage, metrics, part.streamed, cut=not finished)
        if plan is not None:
            plan.close()
    await response.write_eof()
    return response


async def _pump(
    response: web.StreamResponse, ex: Exchange, adapter: Adapter, reply: upstream.Reply,
    reader: StreamReader | resume.Splice, keep: Keep | None, transcript: resume.Transcript | None,
    plan: resuming.Plan | None,
) -> None:
    """Relay one deployment's stream to its end; a break, a stall or an error event raises a GatewayError."""
    # the chat chunks of a step that offered tools, for its tool calls; the other APIs' readers rebuild them
    kept = ex.step.chunks if ex.step is not None and adapter.step_from_chunks else None
    own = transcript if not isinstance(reader, resume.Splice) else None  # a splice extends its progress itself
    strip = plan is not None and plan.asks_token_ids
    previous = b""
    async for chunk in reply.chunks():
        if ex.first_byte_at is None:
            ex.first_byte()
            ex.response_model = chat_wire.model_named(chunk)
        if b'"error"' in chunk and adapter.step_from_chunks:
            chunk, failed = resume.before_error(chunk)  # vLLM reports a failure mid-stream as an error event
            if failed:
                await response.write(reader.feed(_taken(chunk, ex.tap, own, strip)))
                raise UpstreamError(f"Deployment {reply.deployment!r} reported an error mid-stream",
                                    code="upstream_error_event")
        out = reader.feed(_taken(chunk, ex.tap, own, strip))
        if kept is not None:
            previous = _keep_tool_calls(kept, previous, out if own is None else chunk)
        if keep is not None and reader.done:
            await _keep_final(reader, keep)
            keep = None
        if out:
            await response.write(out)
    if not reader.done and reader.error:  # its own error event, withheld: the client gets the gateway's
        raise UpstreamError(f"Deployment {reply.deployment!r} reported an error mid-stream",
                            code="upstream_error_event")
    if not reader.done:
        raise UpstreamError(f"Deployment {reply.deployment!r} ended the stream before its end",
                            code="upstream_truncated")


def _taken(chunk: bytes, tap: list[bytes] | None, transcript: resume.Transcript | None, strip: bool) -> bytes:
    """A deployment's chunk as the client gets it (without the token ids the gateway asked for); the transcript
    keeps it as sent, for a resume to read back."""
    if transcript is not None:
        transcript.add(chunk)
    if strip:
        chunk = resume.strip_token_ids(chunk)
    if tap is not None:
        tap.append(chunk)
    return chunk


def _read_back(adapter: Adapter, call: Call, transcript: resume.Transcript | None,
               plan: resuming.Plan) -> resume.Progress:
    """What the client was sent, read from the stream's transcript, whose bytes are then let go: the splice that
    follows extends its progress itself."""
    progress = resume.read_back(adapter.endpoint, call.body, transcript, plan.blocked)
    if transcript is not None:
        transcript.release()
    return progress


def _release(reply: upstream.Reply, progress: resume.Progress, ex: Exchange, metrics: Metrics) -> None:
    """The broken part: its connection dropped, what it generated charged at its deployment's price (the tokens
    go_on counted: exact where the deployment returned their ids). A later part's deployment read the answer
    before it as its prompt too."""
    reply.close()
    ex.part_ended(progress.part_usage(), metrics)


async def _keep_final(reader: StreamReader | resume.Splice, keep: Keep) -> None:
    final = getattr(reader, "final", None)
    if isinstance(final, dict):
        await keep(final)


def _hand_step_view(ex: Exchange, reader: StreamReader | resume.Splice) -> None:
    """A finished stream of an API other than chat hands the agent step its answer as a chat completion."""
    if ex.step is not None and ex.step.chunks is not None:
        view = reader.answer_view()
        if view is not None:
            ex.step.raw = json_body.encode(view)


def _keep_tool_calls(kept: list[bytes], previous: bytes, chunk: bytes) -> bytes:
    """Keep a stream's bytes from its first tool-call delta on (and the chunk before, which may hold the
    start of that event) for the agent step; returns the chunk, the next call's `previous`."""
    if kept or b'"tool_calls"' in chunk:
        if not kept and previous:
            kept.append(previous)
        kept.append(chunk)
    return chunk
