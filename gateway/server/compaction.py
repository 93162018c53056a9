"""Compaction served by the gateway, for every API that asks for it: the one summarizing call (the policy's
compaction deployment, with the call's failover after it, through its chat completions endpoint), and what each
API makes of the summary.

    written = await summarize(request, call, messages, attempts)      # API-neutral: chat messages in
    answer(...)               # v1_compact, v2_trigger: the summary is the answer, nothing else is forwarded
    compact(...)              # context_management (Responses), compact_20260112 (Messages): the conversation
                              # replaced by its summary, then forwarded as usual (or, paused, answered alone)

Each summary is seen and charged the same way: a summary that is the answer is settled as the answer; one
written before the answer is a side call of the request (Exchange.side_call: its tokens on gateway_tokens_total
and the tenant's spend and budget, settled even when the answer then fails). Every one is counted on
gateway_compactions_total{api,trigger,deployment} and gateway_compaction_tokens_total, the span's
gateway.compaction.* attributes and the decision trail of /admin/requests/{id}/explain.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from gateway.apis.adapter import Adapter
from gateway.apis.responses import compaction as responses_compaction
from gateway.apis.responses import wire as responses
from gateway.apis.responses.adapter import CompactedResponsesAdapter
from gateway.apis.usage import Usage
from gateway.context import anthropic_answers, anthropic_compaction
from gateway.context.anthropic_config import COMPACT
from gateway.context.anthropic_edits import Applied
from gateway.context.counting import input_tokens
from gateway.context.seal import Seal, seal_key
from gateway.context.summaries import context_tokens, summary_prompt
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import UpstreamError
from gateway.policy.model import Policy
from gateway.server import summarizer
from gateway.server.exchanges import add_gateway_headers
from gateway.server.relay import STREAM_HEADERS
from gateway.server.resources import EXCHANGE, STATE
from gateway.server.settings import Settings
from gateway.server.summarizer import Written
from gateway.telemetry import metrics as t

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 2  # a conservative bound for the transcript (`up`'s tokenizer counts ~2.2x cl100k on agent text)
PROMPT_OVERHEAD_TOKENS = 1024  # the instructions and the chat template around the transcript
ANTHROPIC_COMPACT = "anthropic_compact"  # the trigger label of Anthropic's compact_20260112


@dataclass(frozen=True, slots=True)
class Compacted:
    """A call whose conversation the gateway compacted before forwarding it."""

    call: Call  # its body: the summary and what the API keeps beside it
    decision: Decision  # its reasons say so
    adapter: Adapter  # the answer carries the API's compaction form back
    written: Written
    kept_body: dict[str, Any] | None = None  # Responses: what a chain onto its answer reads before that answer
    paused: bool = False  # Anthropic's pause_after_compaction: the compaction block is the whole answer


def make_seal(settings: Settings) -> Seal:
    """The process's seal: the configured key; in development a made-up one, with a warning."""
    key, warning = seal_key(settings.compaction_key, settings.environment == "production")
    if warning is not None:
        log.warning(warning)
    return Seal(key)


def opened(request: web.Request, body: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The body with the compaction items of its input opened (a 400 when one does not open)."""
    items, count = responses_compaction.open_input(responses.input_items(body), request.app[STATE].seal, tenant)
    if not count:
        return body
    ex = request.get(EXCHANGE)
    if ex is not None:
        ex.attributes[t.COMPACTION_ITEMS_OPENED] = count
    return {**body, "input": items}


def asked(adapter: Adapter, call: Call, decided: Decision) -> tuple[str | None, Decision]:
    """What asked the gateway to answer with a compaction itself (v1_compact, v2_trigger), if anything, and the
    decision that answers the call (the compaction's own when asked)."""
    trigger = _asked(adapter, call)
    return trigger, decided if trigger is None else decision_for(call.policy, trigger, decided)


def _asked(adapter: Adapter, call: Call) -> str | None:
    if adapter.path == responses_compaction.COMPACT_PATH:
        return responses_compaction.V1_COMPACT
    return responses_compaction.V2_TRIGGER if adapter.chains and responses_compaction.is_triggered(call.body) else None


def decision_for(policy: Policy, trigger: str, decided: Decision) -> Decision:
    """The compaction's own decision: the policy's compaction deployment first, the decided failover after it."""
    name = policy.compaction.summarizer(policy.deployments, policy.default)
    attempts = (name, *(d for d in decided.attempts if d != name))
    return Decision(name, "compaction", attempts,
                    (f"compaction: {trigger} asked; {name} summarizes (policy compaction.deployment)",))


async def summarize(request: web.Request, call: Call, messages: list[dict[str, Any]],
                    attempts: Sequence[str], instructions: str | None = None) -> Written:
    """The summary of `messages` (chat-shaped), from the first of `attempts` that answers."""
    policy, last = call.policy, None
    for name in attempts:
        try:
            return await _ask(request, policy, name, messages, instructions)
        except UpstreamError as exc:
            log.warning("compaction: deployment %s did not summarize: %s", name, exc.message)
            last = exc
    raise last or UpstreamError("No deployment was asked for the summary")


async def _ask(request: web.Request, policy: Policy, name: str, messages: list[dict[str, Any]],
               instructions: str | None) -> Written:
    rules, dep = policy.compaction, policy.deployments[name]
    window = dep.max_model_len
    max_chars = rules.max_transcript_chars if window is None else \
        max(1_000, (window - rules.max_summary_tokens - PROMPT_OVERHEAD_TOKENS) * CHARS_PER_TOKEN)
    prompt = summary_prompt(messages, max_chars, instructions)
    state = request.app[STATE]
    return await summarizer.write(state.pool, state.settings.max_upstream_body_bytes, policy, name, prompt,
                                  request[EXCHANGE].request_id, rules.max_summary_tokens, context_tokens(messages),
                                  instructions)


def chat_messages(body: dict[str, Any], items: list[Any]) -> list[dict[str, Any]]:
    """A Responses conversation to summarize as chat messages (the API-neutral form): instructions, then items."""
    view: list[dict[str, Any]] = responses.view({"instructions": body.get("instructions"), "input": items})["messages"]
    return view


def note(request: web.Request, api: str, trigger: str, written: Written, tokens_after: int) -> None:
    """The compaction on the metrics, the span and the decision trail."""
    state = request.app[STATE]
    ex = request[EXCHANGE]
    state.metrics.count_compaction(api, trigger, written.deployment, written.tokens_before,
                                                    tokens_after)
    ex.attributes.update({t.COMPACTION_TRIGGER: trigger, t.COMPACTION_DEPLOYMENT: written.deployment,
                          t.COMPACTION_TOKENS_BEFORE: written.tokens_before,
                          t.COMPACTION_TOKENS_AFTER: tokens_after})
    state.recent.compacted(ex.request_id, f"{trigger}: {written.deployment} summarized "
                                  f"{written.tokens_before} tokens into {tokens_after} (summary: "
                                  f"{written.usage.prompt_tokens} in, {written.usage.completion_tokens} out)")


def _sealed(request: web.Request, call: Call, written: Written, kept: list[Any]) -> tuple[dict[str, Any], int]:
    """The compaction item of a summary, and the tokens of what stands in for the conversation now."""
    after = context_tokens(chat_messages({}, [*kept, responses_compaction.summary_message(written.text)]))
    payload = responses_compaction.sealed_payload(written.text, written.deployment, written.tokens_before, after)
    return responses_compaction.compaction_item(request.app[STATE].seal.close(payload, call.tenant_or_anonymous)), after


async def answer(request: web.Request, call: Call, decision: Decision, trigger: str) -> web.StreamResponse:
    """v1_compact and v2_trigger: the summary is the answer, in the form the client asked for."""
    app, ex = request.app, request[EXCHANGE]
    state = app[STATE]
    items = responses_compaction.without_trigger(responses.input_items(call.body))
    written = await summarize(request, call, chat_messages(call.body, items), decision.attempts)
    ex.answered(written.deployment, written.model, call.policy.deployments[written.deployment].price)
    ex.compaction = (trigger, True)
    ex.settle(written.usage, state.metrics)
    kept = responses_compaction.retained(items)
    item, after = _sealed(request, call, written, kept)
    note(request, "responses", trigger, written, after)
    counted = written.usage
    used = responses_compaction.usage(counted.prompt_tokens, counted.completion_tokens, counted.cached_tokens)
    if trigger == responses_compaction.V1_COMPACT:
        listed = [*map(responses_compaction.output_message, kept), item]
        return web.json_response(responses_compaction.compacted(responses.new_response_id(), listed, used))
    final = responses_compaction.response(call.body, responses.new_response_id(), [item], used)
    # kept as the compacted conversation: a chain onto it reads the user's messages, then the summary
    await state.conversations.keeper(call, {**call.body, "input": kept})(final)
    if not call.features.stream:
        return web.json_response(final)
    return await _stream(request, responses_compaction.stream(call.body, final["id"], item, used))


async def compact(request: web.Request, adapter: Adapter, call: Call, decision: Decision) -> Compacted | None:
    """The call with its conversation compacted when its API's compaction is due (Responses: context_management
    over its threshold; Messages: compact_20260112 over its trigger); None when none is due, or when the summary
    fails (the call goes on whole, as the client sent it: its log says why)."""
    trigger = _due(adapter, call)
    if trigger is None:
        return None
    edit = call.context.compaction if call.context is not None else None
    messages = adapter.view(call.body)["messages"] if edit is not None else \
        chat_messages(call.body, responses.input_items(call.body))
    attempts = decision_for(call.policy, trigger, decision).attempts
    try:
        written = await summarize(request, call, messages, attempts, edit.instructions if edit else None)
    except UpstreamError as exc:
        log.warning("compaction (%s) of request %s failed; the call goes on whole: %s", trigger,
                    request[EXCHANGE].request_id, exc.message)
        return None
    request[EXCHANGE].side_call(written.deployment, call.policy.deployments[written.deployment].price,
                                written.usage, request.app[STATE].metrics, compaction=trigger)
    reason = f"compaction: {trigger} due; {written.deployment} summarized {written.tokens_before} tokens"
    decision = replace(decision, reasons=(*decision.reasons, reason))
    if edit is None:
        return _compacted_input(request, call, decision, written)
    return _compacted_messages(request, adapter, call, decision, written)


def _due(adapter: Adapter, call: Call) -> str | None:
    """Which compaction the call asks for before its answer now, if any (none when it is the answer)."""
    if _asked(adapter, call) is not None:
        return None
    if adapter.chains:
        threshold = responses_compaction.threshold_of(call.body)
        due = threshold is not None and call.features.prompt_tokens > threshold
        return responses_compaction.CONTEXT_MANAGEMENT if due else None
    return ANTHROPIC_COMPACT if call.context is not None and call.context.compaction is not None else None


def _compacted_input(request: web.Request, call: Call, decision: Decision, written: Written) -> Compacted:
    """Responses: the input as the user's messages and the summary; the answer's output led by the item."""
    kept = responses_compaction.retained(responses.input_items(call.body))
    item, after = _sealed(request, call, written, kept)
    note(request, "responses", responses_compaction.CONTEXT_MANAGEMENT, written, after)
    body = {**call.body, "input": [*kept, responses_compaction.summary_message(written.text)]}
    return Compacted(_with_body(call, body), decision, CompactedResponsesAdapter(item), written,
                     kept_body={**call.body, "input": kept})


def _compacted_messages(request: web.Request, adapter: Adapter, call: Call, decision: Decision,
                        written: Written) -> Compacted:
    """Messages: the summary alone; the answer's content led by the compaction block (or only that block)."""
    managed = call.context
    assert managed is not None and managed.compaction is not None
    body = anthropic_compaction.compacted_body(managed.body, written.text)
    after = input_tokens(body)
    replaced = len(managed.body.get("messages") or ())
    managed.applied.append(Applied(COMPACT, replaced, max((managed.tokens_after or 0) - after, 0)))
    managed.summary, managed.body, managed.tokens_after = written.text, body, after
    note(request, "messages", ANTHROPIC_COMPACT, written, after)
    return Compacted(_with_body(call, body), decision, adapter, written, paused=managed.compaction.pause_after)


def _with_body(call: Call, body: dict[str, Any]) -> Call:
    """The call with the compacted body the deployment reads; its view, features and session stay those the
    decision read (and the agent's step, which the compaction does not change)."""
    return Call(call.policy, call.endpoint, body, call.view, call.body_bytes, call.features, call.headers,
                call.tenant, call.step, call.chain, call.context, call.masking)


async def answer_paused(request: web.Request, compacted: Compacted) -> web.StreamResponse:
    """Anthropic's pause_after_compaction: the compaction block as the whole answer (streamed when the call
    streams), from the deployment that wrote the summary, whose tokens (a side call) were its whole cost."""
    call, written, ex = compacted.call, compacted.written, request[EXCHANGE]
    assert call.context is not None
    dep = call.policy.deployments[written.deployment]
    ex.trying(written.deployment)
    ex.answered(written.deployment, dep.served_model, dep.price)
    ex.settle(Usage(0, 0), request.app[STATE].metrics)  # the summary was charged as it was made
    message = anthropic_answers.paused(call.context, dep.served_model, written.usage)
    if not call.features.stream:
        return web.json_response(message)
    return await _stream(request, anthropic_answers.paused_stream(message))


async def _stream(request: web.Request, events: bytes) -> web.StreamResponse:
    """An answer the gateway wrote whole, sent as one stream of its API's events."""
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers=STREAM_HEADERS))
    await response.prepare(request)
    await response.write(events)
    await response.write_eof()
    return response
