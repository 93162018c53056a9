"""The OpenAI-compatible handlers: read, decide, forward with failover, relay, settle. Owns no policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from typing import Any

from aiohttp import web

from gateway import openai
from gateway.classifier.scoring import Classifier
from gateway.decision.admission import ANONYMOUS, Admission, SessionState, steered
from gateway.decision.loops import AgentVerdict
from gateway.decision.routing import Context, Decision, decide, needs_complexity
from gateway.decision.sessions import session_id
from gateway.errors import BadRequest, GatewayError, PayloadTooLarge, UpstreamError, UpstreamTimeout
from gateway.features import Features, extract
from gateway.policy.model import Policy, Price
from gateway.server.middleware import add_gateway_headers
from gateway.server.resources import (
    ACCOUNTING,
    CLASSIFIER,
    DEPLOYMENTS,
    EXCHANGE,
    EXPERIMENTS,
    POLICY,
    POOL,
    RECENT,
    SETTINGS,
    SHARES,
    TELEMETRY,
    TENANT,
    TRAJECTORIES,
)
from gateway.steps import read_step
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import Metrics
from gateway.upstream import forward as upstream
from gateway.upstream.deployments import Deployments

STREAM_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "embeddings")


async def _proxy(request: web.Request, endpoint: str) -> web.StreamResponse:
    app, ex = request.app, request[EXCHANGE]
    raw = await read_body(request, app[SETTINGS].max_body_bytes)
    body = openai.decode(raw)
    openai.check(body, endpoint)
    policy = app[POLICY].current
    features = extract(body, endpoint)
    tenant = request.get(TENANT)
    if tenant is not None:
        ex.tenant = tenant
    trajectories = app[TRAJECTORIES]
    sid = session_id(request.headers, body) if trajectories.recording(policy, features, request.headers) else None
    agent = None
    if sid is not None and policy.agents.enforcing:  # a loop or spike may escalate, steer or stop this step
        agent = await trajectories.verdict(policy, tenant or ANONYMOUS, sid, ex)
    accounting = app[ACCOUNTING] if steered(policy, request.headers) else None
    admitted = None
    if accounting is not None:  # tenancy configured, or a cost cap asked for: budget and session verdict
        admitted = await accounting.admit(tenant, request.headers, policy, features, body, len(raw))
        ctx = context(app, request.headers, tenant, features, policy, admitted.verdict, admitted.session, body=body,
                      agent=agent)
    else:
        ctx = context(app, request.headers, tenant, features, policy, body=body, agent=agent)
    decision = decide(policy, features, ctx)
    experiments, enrollment = app[EXPERIMENTS], None
    if experiments.engaged(policy):
        enrollment = await experiments.begin(ex, request.headers, policy, features, ctx, decision, body)
        decision = enrollment.decision  # a rollout's candidate arm
    if sid is not None:
        cohorted = enrollment.cohorted() if enrollment is not None else None
        trajectories.begin(ex, policy, tenant or ANONYMOUS, sid, body, features, cohorted)
    app[RECENT].remember(ex.request_id, policy, features, ctx)
    ex.decided(features, decision, ctx.complexity)
    caps = admitted.caps if admitted is not None else None

    def direct(held: Decision) -> Awaitable[web.StreamResponse]:
        return _forward(request, policy, held, body, features, caps)

    # with experiments, shadows start and samples count only once the call is past the budget hold
    forward = enrollment.forwarding(direct) if enrollment is not None else direct
    forwarded: Awaitable[web.StreamResponse]
    if accounting is not None and admitted is not None:
        forwarded = accounting.follow(admitted, policy, decision, ex, forward)
    else:
        forwarded = forward(decision)
    if enrollment is not None:
        return await enrollment.follow(forwarded)
    return await forwarded


def context(
    app: web.Application,
    headers: Mapping[str, str],
    tenant: str | None,
    features: Features,
    policy: Policy,
    admission: Admission | None = None,
    session: SessionState | None = None,
    *,
    observed: bool = True,
    body: Mapping[str, Any] | None = None,
    agent: AgentVerdict | None = None,
) -> Context:
    """Gather the decision's inputs besides the body: headers, tenant, score, load, budget and agent verdicts,
    and the route's live share thresholds (`observed`: this call counts toward them; False for a dry run)."""
    complexity = None
    if needs_complexity(policy):
        complexity = _score(policy.classifier_or(app[CLASSIFIER]), app[TELEMETRY].metrics, features)
    thresholds: Mapping[float, float] = {}
    if complexity is not None and policy.share_windows and features.requested_model in policy.rule_routes:
        shares = app[SHARES]
        shares.follow(policy)
        route = features.requested_model
        thresholds = shares.observe(route, complexity) if observed else shares.thresholds(route)
    step = read_step(body) if body is not None and policy.reads_steps else None
    deployments = app[DEPLOYMENTS]
    return Context(headers=headers, tenant=tenant, complexity=complexity, load=dict(deployments.load),
                   in_flight=deployments.in_flight_now(), admission=admission, session=session,
                   share_thresholds=thresholds, step=step, agent=agent)


def _score(classifier: Classifier, metrics: Metrics, features: Features) -> float:
    started = time.perf_counter()
    score = classifier.score(features)
    cost = metrics.scoring
    cost.seconds += time.perf_counter() - started
    cost.scores += 1
    return score


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"The request body is {request.content_length} bytes; the limit is {limit}")
    try:
        raw = await _read_chunked(request, limit) if request.content_length is None else await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes") from exc
    if len(raw) > limit:
        raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes")
    if not raw:
        raise BadRequest("The request body is empty; send a JSON object")
    return raw


async def _read_chunked(request: web.Request, limit: int) -> bytes:
    """A body without Content-Length, read to its end but never past limit + 1 bytes."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        part = await request.content.read(limit + 1 - size)
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


async def _forward(
    request: web.Request, policy: Policy, decision: Decision, body: dict[str, Any], features: Features,
    caps: Mapping[str, int] | None = None,
) -> web.StreamResponse:
    """Try the decision's deployments in order; fail over only before the first byte reaches the client."""
    ex, pool, deployments = request[EXCHANGE], request.app[POOL], request.app[DEPLOYMENTS]
    metrics = request.app[TELEMETRY].metrics
    headers = upstream.forwardable(request.headers)
    headers["x-request-id"] = ex.request_id
    if ex.trace is not None:  # the deployment's spans become children of this request's span
        headers["traceparent"] = ex.trace.traceparent()
    last: GatewayError | None = None
    limit = request.app[SETTINGS].max_upstream_body_bytes
    for name in decision.attempts:
        dep = policy.deployments[name]
        payload, client_wants_usage = openai.upstream_body(body, dep.served_model, caps.get(name) if caps else None)
        deployments.in_flight[name] = deployments.in_flight.get(name, 0) + 1
        ex.trying(name)
        try:
            try:
                reply = await upstream.send(pool, name, dep, openai.PATHS[features.endpoint], payload, headers)
                answer = await upstream.answer(reply, features.stream, limit)
            except (UpstreamError, UpstreamTimeout) as exc:
                deployments.record_failure(name)
                metrics.failovers.labels(name, exc.code or exc.error_type).inc()
                last = exc.with_traceback(None)  # kept, its traceback would tie this frame into a cycle
                continue
            except asyncio.CancelledError:
                _left_while_answering(ex, metrics, name, dep.price)
                raise
            if answer is None:
                ex.answered(name, None, dep.price)  # the model it names is read from the stream's first event
                return await _relay_stream(request, deployments, metrics, reply, client_wants_usage)
            raw, found = answer
            ex.answered(name, found.get("model") if isinstance(found.get("model"), str) else None, dep.price)
            return _relay_body(request, deployments, metrics, reply, raw, found)
        finally:
            deployments.in_flight[name] -= 1
    raise last or UpstreamError("No deployment was tried")


def _left_while_answering(ex: Exchange, metrics: Metrics, name: str, price: Price) -> None:
    """The client left while the deployment had its request: the prompt was taken in (prefill comes
    first) and is charged; what it generated before the call was cancelled cannot be told, and is not."""
    ex.answered(name, None, price)
    ex.settle(openai.Usage(ex.prompt_tokens, 0, estimated=True), metrics)


def _relay_body(
    request: web.Request, deployments: Deployments, metrics: Metrics, reply: upstream.Reply, raw: bytes,
    found: dict[str, Any],
) -> web.Response:
    ex: Exchange = request[EXCHANGE]
    if ex.tap is not None:
        ex.tap.append(raw)
    if ex.step is not None and ex.step.chunks is not None and reply.status == 200:
        ex.step.raw = raw  # the agent step reads the tool calls out of it, later, off the request path
    if reply.status == 200:
        deployments.record_success(reply.deployment)
        ex.settle(openai.usage_of(found), metrics)
    return web.Response(body=raw, status=reply.status, headers=upstream.reply_headers(reply))


async def _relay_stream(
    request: web.Request, deployments: Deployments, metrics: Metrics, reply: upstream.Reply, client_wants_usage: bool
) -> web.StreamResponse:
    """Relay SSE events as they arrive; learn usage; a failure after the first byte becomes one error event."""
    ex: Exchange = request[EXCHANGE]
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers=STREAM_HEADERS))
    await response.prepare(request)
    relay = _StreamRelay(client_wants_usage)
    finished = False
    tap = ex.tap
    kept = ex.step.chunks if ex.step is not None else None  # None unless the request offered tools
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
            out = relay.feed(chunk)
            if out:
                await response.write(out)
        if not relay.done:
            raise UpstreamError(f"Deployment {reply.deployment!r} ended the stream before [DONE]",
                                code="upstream_truncated")
        finished = True
        deployments.record_success(reply.deployment)
    except GatewayError as exc:
        deployments.record_failure(reply.deployment)
        ex.failed_mid_stream(exc)
        await response.write(openai.error_event(exc))
    finally:
        # An unfinished stream (error, client gone, cancelled) must stop the deployment's generation too.
        reply.release() if finished else reply.close()
        ex.settle(relay.usage, metrics, relay.streamed)
    await response.write_eof()
    return response


def _keep_tool_calls(kept: list[bytes], previous: bytes, chunk: bytes) -> bytes:
    """Keep a stream's bytes from its first tool-call delta on (and the chunk before, which may hold the
    start of that event) for the agent step; returns the chunk, the next call's `previous`."""
    if kept or b'"tool_calls"' in chunk:
        if not kept and previous:
            kept.append(previous)
        kept.append(chunk)
    return chunk


class _StreamRelay:
    """Splits the upstream byte stream into SSE events, takes the usage chunk, notes [DONE]."""

    __slots__ = ("_pending", "client_wants_usage", "done", "streamed", "usage")

    def __init__(self, client_wants_usage: bool) -> None:
        self.client_wants_usage = client_wants_usage
        self._pending = b""
        self.usage: openai.Usage | None = None
        self.done = False
        self.streamed = openai.StreamTally()  # what was generated, should the usage chunk never come

    def feed(self, chunk: bytes) -> bytes:
        self.streamed.add(chunk)
        # Nearly every chunk is whole content events: pass those through without splitting them.
        if not self._pending and chunk.endswith(b"\n\n") and b'"usage"' not in chunk and b"[DONE]" not in chunk:
            return chunk
        events, self._pending = openai.split_events(self._pending + chunk)
        if not events:
            return b""
        kept = []
        for event in events:
            if openai.is_usage_event(event):
                self.usage = openai.usage_of(openai.event_data(event))
                if not self.client_wants_usage:
                    continue
            elif event.startswith(openai.DONE_EVENT):
                self.done = True
            kept.append(event)
        return b"".join(kept)


async def models(request: web.Request) -> web.Response:
    policy = request.app[POLICY].current
    data = [{"id": name, "object": "model", "owned_by": "agent-gateway", "created": 0,
             "description": model.description} for name, model in policy.models.items()]
    return web.json_response({"object": "list", "data": data})
