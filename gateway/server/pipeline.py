"""The request path as one pipeline of named stages, the same for every API the gateway serves:

    read → decide → admit → forward (with failover) → relay → settle → record

Each API is an adapter at the two ends (gateway/apis/): it reads the native body into the one view of the call
(gateway/decision/call.py) and writes answers, stream events, usage and errors back in its own format. No stage
after `read` knows which API a call came in on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.accounting.ledger import Admitted
from gateway.agents.loops import AgentVerdict
from gateway.apis.adapter import Adapter
from gateway.context.masking import Masking, MaskRule
from gateway.context.tool_outputs import ToolOutputs
from gateway.decision import windows
from gateway.decision.admission import ANONYMOUS, needs_admission
from gateway.decision.agent_compaction import FIT_RULES, FIT_TURNS, compaction_asker
from gateway.decision.call import Call, read_call
from gateway.decision.gathering import Surroundings, gather
from gateway.decision.routing import Context, Decision, decide
from gateway.errors import BadRequest, ContextTooLong, GatewayError, PayloadTooLarge
from gateway.experiments.hook import CLIENT_CLOSED, Enrollment
from gateway.policy.model import LIVE_POLICY, Policy
from gateway.rollout.samples import Cohort
from gateway.server import compaction, relay
from gateway.server.evictions import EVICTED, Evicted
from gateway.server.live_scores import LiveScoring
from gateway.server.resources import EXCHANGE, STATE, TENANT
from gateway.server.retrieval import AS_SENT, WITHOUT_BLOCK
from gateway.server.session_caches import Sighting
from gateway.store.contract import Reservation
from gateway.telemetry import metrics as t
from gateway.telemetry.exchange import Exchange


def handler(adapter: Adapter) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler of one API: the pipeline with that API's adapter at its ends."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await run(request, adapter)

    handle.__name__ = f"{adapter.endpoint}_handler"
    return handle


async def run(request: web.Request, adapter: Adapter) -> web.StreamResponse:
    app, ex = request.app, request[EXCHANGE]
    state = app[STATE]
    call = await read(request, adapter)
    ex.tenant = call.tenant_or_anonymous
    recording = state.trajectories.recording(call)  # asked once: the verdict and the record both need it
    agent = await verdict(app, call, ex, recording)
    admitted = await admit(app, call)
    call, sighting, ctx, decision = await decided(request, adapter, call, admitted, agent)
    asked, decision = compaction.asked(adapter, call, decision)  # the gateway answers with a compaction itself
    experiments = state.experiments
    engaged = asked is None and experiments.engaged(call.policy)
    enrollment = await experiments.begin(ex, call, ctx, decision, request.get(AS_SENT)) if engaged else None
    if enrollment is not None:
        decision = enrollment.decision  # a rollout's candidate arm
        call = await candidate_context(request, adapter, call, enrollment)
    status, held = 500, None
    try:
        try:
            held, decision = await hold(app, admitted, call.policy, decision)
        except GatewayError:
            ex.decided(call.features, decision, ctx.complexity)  # refused by the budget: no deployment reached
            raise
        compacted = await compaction.compact(request, adapter, call, decision)  # when its API's compaction is due
        if compacted is not None:
            call, decision, adapter = compacted.call, compacted.decision, compacted.adapter
        record(app, ex, adapter, call, ctx, decision, enrollment, recording)
        if enrollment is not None:
            enrollment.sent()
        caps = windows.caps(admitted.caps if admitted else None, ctx.fits)
        response = await answer(request, adapter, call, decision, caps, asked, compacted)
        status = response.status
        if asked is None and compacted is None:  # else the gateway rewrote or answered the prompt sighted
            # Once the answer is written (aiohttp writes a whole answer after the handler returns): a client
            # waits for its answer, not for these records. Before the exchange's own record, which reads them.
            asyncio.get_running_loop().call_soon(served, app, adapter, call, decision, sighting, ex,
                                                 request.get(EVICTED))
        return response
    except GatewayError as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away
        status = CLIENT_CLOSED
        raise
    finally:
        if held is not None:
            # Shielded: a client that disconnects cancels the handler, and the hold must still be settled or freed.
            await asyncio.shield(state.accounting.close(held, call.policy, ex))
        if enrollment is not None:
            experiments.finished(enrollment, status)


async def decided(
    request: web.Request, adapter: Adapter, call: Call, admitted: Admitted | None, agent: AgentVerdict | None,
) -> tuple[Call, Sighting | None, Context, Decision]:
    """The decision, and the call it is for: a call that fits no deployment's window is masked until it fits one
    when it is an agent's own summary request or its policy manages context (its oldest tool outputs first,
    keeping fewer of the newest each time; then, where context is managed, assistant turns over FIT_TURNS'
    size: an agent's own runaway answer)."""
    app = request.app
    try:
        return (call, *await _decision(app, call, admitted, agent, observed=True))
    except ContextTooLong as exc:
        managed = call.policy.masks_context or call.policy.summarizes_context
        if adapter.tool_outputs is None or (compaction_asker(call.features.last_user_text) is None and not managed):
            raise
        too_long = exc
    # each try from the call as sent, its tool outputs masked ever more; the last one on top of the strictest
    tries: list[tuple[ToolOutputs, MaskRule, bool]] = [(adapter.tool_outputs, rule, False) for rule in FIT_RULES]
    if managed and adapter.assistant_texts is not None:
        tries.append((adapter.assistant_texts, FIT_TURNS, True))
    fitted: Call | None = call
    for shape, rule, on_top in tries:
        fitted = await _masked(app, adapter, shape, fitted if on_top and fitted is not None else call, rule)
        if fitted is None:  # the object store failed: no stub may name an original it does not hold
            break
        with contextlib.suppress(ContextTooLong):
            return (fitted, *await _decision(app, fitted, admitted, agent, observed=False))
    raise too_long


async def _decision(app: web.Application, call: Call, admitted: Admitted | None, agent: AgentVerdict | None,
                    observed: bool) -> tuple[Sighting | None, Context, Decision]:
    state = app[STATE]
    sighting = await sight(app, call)
    counts = await state.counts.count(call, state.deployments.windows)  # {} unless a window's edge is near
    ctx = gather(call, LiveScoring(app, observed), surroundings(app, admitted, agent, sighting, counts))
    return sighting, ctx, decide(call.policy, call.features, ctx)


async def _masked(app: web.Application, adapter: Adapter, shape: ToolOutputs, call: Call,
                  rule: MaskRule) -> Call | None:
    """The call with the texts `shape` finds (tool outputs, assistant turns) masked by `rule` (None when the
    originals could not be stored)."""
    body, masking = await app[STATE].offload.mask_by(shape, rule, call.body, call.tenant_or_anonymous)
    if masking is None:
        return None
    view = adapter.view(body)
    return read_call(call.policy, adapter.endpoint, body, view, call.body_bytes, adapter.features(view, call.sent),
                     call.headers, call.tenant, call.chain, call.context, masking, call.sent)


def served(app: web.Application, adapter: Adapter, call: Call, decision: Decision, sighting: Sighting | None,
           ex: Exchange, evicted: Evicted | None = None) -> None:
    """The deployment's cache now holds the prompt sighted: recorded, and the session's next step warmed; the
    summary of old turns now due is written for the next step."""
    state = app[STATE]
    if sighting is not None:
        state.session_caches.served(call, sighting, ex)
        state.warmups.after(adapter, call, decision, sighting, ex)
    if evicted is not None:
        state.evictions.after(adapter, call, evicted, ex)


async def answer(
    request: web.Request, adapter: Adapter, call: Call, decision: Decision, caps: Mapping[str, int] | None,
    asked: str | None, compacted: compaction.Compacted | None,
) -> web.StreamResponse:
    """The answer: a compaction the gateway writes itself, else the deployments' (forwarded in failover order)."""
    if asked is not None:
        return await compaction.answer(request, call, decision, asked)
    if compacted is not None and compacted.paused:
        return await compaction.answer_paused(request, compacted)
    keep = None
    if adapter.chains:
        kept = compacted.kept_body if compacted is not None else request.get(WITHOUT_BLOCK)
        keep = request.app[STATE].conversations.keeper(call, kept)
    return await relay.forward(request, adapter, call, decision, caps, keep)


async def read(request: web.Request, adapter: Adapter) -> Call:
    """The one view of the call: the body read within its limit, checked, its features and agent step."""
    state = request.app[STATE]
    raw = await read_body(request, state.settings.max_body_bytes)
    sent = adapter.parse(raw, state.recurring)
    body = sent.body
    policy = state.policy_file.current
    # Only tenant auth names a tenant: without it, no lookup (a missing key costs the mapping a KeyError).
    tenant, chain = request.get(TENANT) if policy.auth.enabled else None, None
    if adapter.chains:  # the full conversation, from the gateway's own store, whichever deployment served it
        body, chain = await state.conversations.expand(body, tenant or ANONYMOUS)
        body = compaction.opened(request, body, tenant or ANONYMOUS)  # no deployment reads a compaction item
    body, managed = adapter.manage_context(body)  # the decision reads what the deployment will
    view, masking = None, None
    if policy.manages_context:  # the policy's context rules (or a candidate's): the body as sent kept beside
        request[AS_SENT] = body
        body, view, masking = await manage_context(request, adapter, policy, body, tenant)
    view = adapter.view(body) if view is None else view
    return read_call(policy, adapter.endpoint, body, view, len(raw), adapter.features(view, sent), request.headers,
                     tenant, chain, managed, masking, sent)


async def manage_context(request: web.Request, adapter: Adapter, rules: Policy, body: dict[str, Any],
                         tenant: str | None) -> tuple[dict[str, Any], Mapping[str, Any], Masking | None]:
    """The body as `rules`' context rules make it (and its view, and what was masked): old turns given way to a
    summary written after an earlier step (as sent: sticky), old tool outputs masked (their originals stored
    first), and what those took out put back where the step is about it."""
    if rules.summarizes_context:
        body = summarize_old_turns(request, adapter, rules, body, tenant)
    masking = None
    if rules.masks_context:
        body, masking = await request.app[STATE].offload.mask(adapter.tool_outputs, rules, body, tenant,
                                                              tenant or ANONYMOUS)
    view = adapter.view(body)
    if rules.retrieves_context:
        body, view = await put_back(request, adapter, rules, body, view, tenant, masking)
    return body, view, masking


async def candidate_context(request: web.Request, adapter: Adapter, call: Call, enrollment: Enrollment) -> Call:
    """On a rollout's candidate arm whose candidate policy has context rules of its own, the call as they make
    it (the arm's decision read the prompt as the live rules made it; its deployment reads the candidate's)."""
    spec = enrollment.spec
    if spec is None or enrollment.cohort is not Cohort.CANDIDATE or AS_SENT not in request:
        return call
    kind, _, name = spec.candidate.partition(":")
    if kind != "policy" or name == LIVE_POLICY:
        return call
    candidate = call.policy.candidate_policy(name)
    route = call.features.requested_model
    if candidate.context_of(route, call.tenant) == call.policy.context_of(route, call.tenant):
        return call
    for key in (EVICTED, WITHOUT_BLOCK):
        request.pop(key, None)
    request[EXCHANGE].context_managed_again()
    body, view, masking = await manage_context(request, adapter, candidate, request[AS_SENT], call.tenant)
    return read_call(call.policy, call.endpoint, body, view, call.body_bytes, adapter.features(view, call.sent),
                     call.headers, call.tenant, call.chain, call.context, masking, call.sent)


def summarize_old_turns(request: web.Request, adapter: Adapter, policy: Policy, body: dict[str, Any],
                        tenant: str | None) -> dict[str, Any]:
    """The body with the newest ready summary of its old turns in place; what is due is kept for `after`."""
    rule = policy.evict_rule(str(body.get("model")), tenant)
    if rule is None or adapter.turns is None:
        return body
    section = policy.retrieve_rule(str(body.get("model")), tenant)
    body, evicted = request.app[STATE].evictions.apply(adapter.turns, rule, body, tenant or ANONYMOUS,
                                                       None if section is None else section.embeddings)
    if evicted is not None:
        request[EVICTED] = evicted
        request[EXCHANGE].summarized_turns(evicted.entries, evicted.tokens_saved, evicted.due,
                                           evicted.used == evicted.due)
    return body


async def put_back(request: web.Request, adapter: Adapter, policy: Policy, body: dict[str, Any],
                   view: Mapping[str, Any], tenant: str | None,
                   masking: Masking | None) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The body and its view with the offloaded pieces most relevant to the step in one block at the end."""
    section = policy.retrieve_rule(str(body.get("model")), tenant)
    if section is None or adapter.block is None:
        return body, view
    library, owner = request.app[STATE].library, tenant or ANONYMOUS
    refs: list[tuple[str, bool]] = []
    if masking is not None:
        for m in masking.masked:
            if m.original is not None:
                library.index(owner, m.ref, [m.original], section.embeddings)
            refs.append((m.ref, False))
    evicted = request.get(EVICTED)
    if evicted is not None and evicted.ref is not None:
        refs.append((evicted.ref, True))
    if not refs:
        return body, view
    sent, found = await library.put_back(adapter.block, section.rule(), section.embeddings, body, view, owner, refs)
    if found is None:
        return body, view
    request[EXCHANGE].retrieved_pieces(len(found.chosen), found.tokens, found.describe())
    if not found.chosen:
        return body, view
    request[WITHOUT_BLOCK] = body  # what a stored conversation keeps: the block is this step's alone
    return sent, adapter.view(sent)


async def verdict(app: web.Application, call: Call, ex: Exchange, recording: bool) -> AgentVerdict | None:
    """What the session's active loop or spike flags ask of this step (escalate, steer, stop), if anything."""
    if not recording or not call.policy.agents.enforcing:
        return None
    sid = call.session_id
    if sid is None:
        return None
    return await app[STATE].trajectories.verdict(call.policy, call.tenant_or_anonymous, sid, ex)


async def sight(app: web.Application, call: Call) -> Sighting | None:
    """What each deployment's prefix cache holds of the session's prompt, when the policy prices switches; the
    session's warm-up still in flight is stale now that its next step is here."""
    state = app[STATE]
    if call.policy.switch is None:
        return None
    if call.session_id is not None:
        state.warmups.arrived(call.tenant_or_anonymous, call.session_id)
    return await state.session_caches.sighting(call)


async def admit(app: web.Application, call: Call) -> Admitted | None:
    """The budget and session verdict, when tenancy is configured or the call caps its own cost."""
    if not needs_admission(call.policy, call.headers):
        return None
    return await app[STATE].accounting.admit(call)


def surroundings(
    app: web.Application, admitted: Admitted | None, agent: AgentVerdict | None, sighting: Sighting | None = None,
    counts: Mapping[str, windows.Count] | None = None,
) -> Surroundings:
    deployments = app[STATE].deployments
    return Surroundings(
        load=dict(deployments.load), in_flight=deployments.in_flight_now(),
        admission=admitted.verdict if admitted is not None else None,
        session=admitted.session if admitted is not None else None, agent=agent,
        cache=sighting.cache if sighting is not None else None,
        windows=deployments.windows, counts=counts or {},
    )


async def hold(
    app: web.Application, admitted: Admitted | None, policy: Policy, decision: Decision
) -> tuple[Reservation | None, Decision]:
    """Hold the call's worst case against the tenant's budget; near a hard limit this may narrow the failover."""
    if admitted is None or not policy.accounted:
        return None, decision  # only a cost-cap header steered this call: nothing to account
    return await app[STATE].accounting.hold(admitted, policy, decision)


def record(
    app: web.Application, ex: Exchange, adapter: Adapter, call: Call, ctx: Context, decision: Decision,
    enrollment: Enrollment | None, recording: bool,
) -> None:
    """The decision as admission left it goes on the request record, the explain memory and the agent step, with
    the context edits that made the prompt."""
    state = app[STATE]
    ex.decided(call.features, decision, ctx.complexity)
    managed = call.context
    clearings = managed.clearings() if managed is not None else ()
    if managed is not None and clearings:  # a compaction is counted apart, by its runtime (gateway_compactions_total)
        ex.edited([(a.type, a.cleared, a.cleared_input_tokens) for a in clearings], managed.tokens_before,
                  managed.tokens_after)
    masking = call.masking
    if masking is not None and masking.masked:
        ex.masked_outputs(len(masking.masked), masking.tokens_saved, masking.frontier)
    state.recent.remember(ex.request_id, call, ctx, decision, ex.context_notes)
    asker = compaction_asker(call.features.last_user_text)
    if asker is not None:  # rare: counted at once
        ex.attributes[t.AGENT_COMPACTION] = asker
        ex.compaction = (asker, True)  # the whole answer is the agent's summary: its cost counted as one
        state.metrics.agent_compaction_requests.labels(asker, decision.deployment).inc()
    if recording and adapter.generates and call.session_id is not None:
        state.trajectories.begin(ex, call, enrollment.cohorted() if enrollment is not None else None)


async def read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length  # parsed from the header at each access: read once
    if length is not None and length > limit:
        raise PayloadTooLarge(f"The request body is {length} bytes; the limit is {limit}")
    raw = await _read_uncached(request, limit)
    if len(raw) > limit:
        raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes")
    if not raw:
        raise BadRequest("The request body is empty; send a JSON object")
    return raw


async def _read_uncached(request: web.Request, limit: int) -> bytes:
    """The body, read to its end but never past limit + 1 bytes, from the request's stream.

    Not through request.read(), which keeps the body on the request: aiohttp's connection handler holds its
    last request while it waits for the next one on a kept-alive connection, so each idle agent connection
    would keep its last 100-200 KB body for up to the keep-alive timeout (200 idle agents: 30 MB).
    """
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        part = await request.content.read(limit + 1 - size)
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)

