"""Anthropic's compaction, the part that calls a deployment: the summary written by the deployment the decision
chose, through its chat completions endpoint; and the answer of a call that pauses after its compaction.

The summary's own prompt and the compacted body are gateway/context/anthropic_compaction.py's (pure). A summary
that fails leaves the conversation whole: the call goes on as the client sent it, and its trail says why.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway import openai
from gateway.apis.adapter import Adapter
from gateway.context import anthropic_answers
from gateway.context import anthropic_compaction as compaction
from gateway.context.anthropic_config import COMPACT
from gateway.context.anthropic_edits import Applied
from gateway.context.counting import input_tokens
from gateway.decision.call import Call, read_call
from gateway.decision.routing import Decision
from gateway.errors import GatewayError
from gateway.server.exchanges import add_gateway_headers
from gateway.server.resources import EXCHANGE, POOL, SETTINGS, TELEMETRY
from gateway.upstream import forward as upstream

log = logging.getLogger(__name__)


async def compact(request: web.Request, adapter: Adapter, call: Call, decision: Decision) -> Call:
    """The call with its conversation replaced by a summary when its compaction is due (else the call as it is)."""
    managed = call.context
    if managed is None or managed.compaction is None:
        return call
    app, ex = request.app, request[EXCHANGE]
    name = decision.attempts[0]
    dep = call.policy.deployments[name]
    summary_body = compaction.summary_request(managed.body, managed.compaction.instructions, dep.served_model)
    try:
        fetched = await upstream.fetch(app[POOL], name, dep, openai.PATHS["chat"], openai.encode(summary_body),
                                       {"x-request-id": ex.request_id}, timeout_s=dep.timeouts.total_s,
                                       limit_bytes=app[SETTINGS].max_upstream_body_bytes)
        answer = openai.decode(fetched.body) if fetched.status == 200 else {}
    except GatewayError as exc:
        log.warning("compaction of request %s failed on %s: %s", ex.request_id, name, exc.message)
        return call
    usage = openai.usage_of(answer)
    if usage is not None:
        ex.side_call(name, dep.price, usage, app[TELEMETRY].metrics)
    summary = compaction.summary_of(answer)
    if summary is None:
        log.warning("compaction of request %s: %s answered %d without a summary", ex.request_id, name, fetched.status)
        return call
    body = compaction.compacted_body(managed.body, summary)
    replaced = len(managed.body.get("messages") or ())
    after = input_tokens(body)
    managed.applied.append(Applied(COMPACT, replaced, max((managed.tokens_after or 0) - after, 0)))
    managed.summary, managed.body, managed.tokens_after = summary, body, after
    view = adapter.view(body)
    return read_call(call.policy, call.endpoint, body, view, call.body_bytes, adapter.features(view), call.headers,
                     call.tenant, call.chain, managed)


def paused(call: Call) -> bool:
    """The call compacted and asked to stop there: its answer is the compaction block alone."""
    managed = call.context
    return (managed is not None and managed.summary is not None and managed.compaction is not None
            and managed.compaction.pause_after)


async def answer_paused(request: web.Request, call: Call, decision: Decision) -> web.StreamResponse:
    """The compaction block as the whole answer (streamed when the call streams); the summary's deployment
    answered it, and the summary's tokens were its cost."""
    assert call.context is not None
    ex = request[EXCHANGE]
    name = decision.attempts[0]
    dep = call.policy.deployments[name]
    ex.trying(name)
    ex.answered(name, dep.served_model, dep.price)
    ex.settle(openai.Usage(0, 0), request.app[TELEMETRY].metrics)  # the summary was charged as it was made
    spent = ex.side_parts[-1][2] if ex.side_parts else openai.Usage(0, 0)
    message = anthropic_answers.paused(call.context, dep.served_model, spent)
    if not call.features.stream:
        return web.json_response(message)
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers={
        "content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}))
    await response.prepare(request)
    await response.write(anthropic_answers.paused_stream(message))
    await response.write_eof()
    return response
