"""Compaction served by the gateway: the summarizing call to the policy's compaction deployment (its chat
completions endpoint, whatever API the client compacts through), and the Responses API's answers to it.

    written = await summarize(request, call, messages, attempts)      # API-neutral: chat messages in
    answer(...)                       # v1_compact and v2_trigger: the gateway answers, nothing is forwarded
    compact_input(...)                # context_management: the input compacted, then forwarded as usual

Each summary is seen and charged: its deployment's tokens and cost on the request (and the tenant's budget
with it), gateway_compactions_total and gateway_compaction_tokens_total, the span's gateway.compaction.*
attributes and the decision trail of /admin/requests/{id}/explain.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway import openai
from gateway.apis.adapter import Adapter
from gateway.apis.agent_apis import CompactedResponsesAdapter
from gateway.apis.responses import compaction as wire
from gateway.context.seal import Seal, seal_key
from gateway.context.summaries import context_tokens, read_summary, summary_prompt
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import UpstreamError
from gateway.policy.model import Policy
from gateway.server.exchanges import add_gateway_headers
from gateway.server.relay import STREAM_HEADERS
from gateway.server.resources import CONVERSATIONS, EXCHANGE, POOL, RECENT, SEAL, SETTINGS, TELEMETRY
from gateway.settings import Settings
from gateway.telemetry import metrics as t
from gateway.upstream import forward as upstream
from gateway.wire import responses

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
CHARS_PER_TOKEN = 2  # a conservative bound for the transcript (`up`'s tokenizer counts ~2.2x cl100k on agent text)
PROMPT_OVERHEAD_TOKENS = 1024  # the instructions and the chat template around the transcript


@dataclass(frozen=True, slots=True)
class Written:
    """A summary as a deployment wrote it, and what it replaced."""

    text: str  # in the anchored structure (gateway/context/summaries.py)
    deployment: str
    model: str | None
    usage: openai.Usage
    tokens_before: int  # the conversation it summarized, in the gateway's count


def make_seal(settings: Settings) -> Seal:
    """The process's seal: the configured key; in development a made-up one, with a warning."""
    key, warning = seal_key(settings.compaction_key, settings.environment == "production")
    if warning is not None:
        log.warning(warning)
    return Seal(key)


def opened(request: web.Request, body: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The body with the compaction items of its input opened (a 400 when one does not open)."""
    items, count = wire.open_input(responses.input_items(body), request.app[SEAL], tenant)
    if not count:
        return body
    ex = request.get(EXCHANGE)
    if ex is not None:
        ex.attributes[t.COMPACTION_ITEMS_OPENED] = count
    return {**body, "input": items}


def asked(adapter: Adapter, call: Call) -> str | None:
    """What asked the gateway to answer with a compaction itself (v1_compact, v2_trigger), if anything."""
    if adapter.path == wire.COMPACT_PATH:
        return wire.V1_COMPACT
    return wire.V2_TRIGGER if adapter.chains and wire.is_triggered(call.body) else None


def decision_for(policy: Policy, trigger: str, decided: Decision) -> Decision:
    """The compaction's own decision: the policy's compaction deployment first, the decided failover after it."""
    name = policy.compaction.summarizer(policy.deployments, policy.default)
    attempts = (name, *(d for d in decided.attempts if d != name))
    return Decision(name, "compaction", attempts,
                    (f"compaction: {trigger} asked; {name} summarizes (policy compaction.deployment)",))


async def summarize(request: web.Request, call: Call, messages: list[dict[str, Any]],
                    attempts: Sequence[str]) -> Written:
    """The summary of `messages` (chat-shaped), from the first of `attempts` that answers."""
    policy, last = call.policy, None
    for name in attempts:
        try:
            return await _ask(request, policy, name, messages)
        except UpstreamError as exc:
            log.warning("compaction: deployment %s did not summarize: %s", name, exc.message)
            last = exc
    raise last or UpstreamError("No deployment was asked for the summary")


async def _ask(request: web.Request, policy: Policy, name: str, messages: list[dict[str, Any]]) -> Written:
    app, rules, dep = request.app, policy.compaction, policy.deployments[name]
    window = dep.max_model_len
    max_chars = rules.max_transcript_chars if window is None else \
        max(1_000, (window - rules.max_summary_tokens - PROMPT_OVERHEAD_TOKENS) * CHARS_PER_TOKEN)
    body = {"model": dep.served_model, "messages": summary_prompt(messages, max_chars),
            "max_tokens": rules.max_summary_tokens, "temperature": 0, "stream": False}
    headers = {"x-request-id": request[EXCHANGE].request_id}
    fetched = await upstream.fetch(app[POOL], name, dep, CHAT_PATH, openai.encode(body), headers,
                                   timeout_s=rules.timeout_s, limit_bytes=app[SETTINGS].max_upstream_body_bytes)
    found = openai.response_object(fetched.body) if fetched.status == 200 else None
    choices = found.get("choices") if found is not None else None
    message = choices[0].get("message") if isinstance(choices, list) and choices and \
        isinstance(choices[0], dict) else None
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise UpstreamError(f"Deployment {name!r} wrote no summary (status {fetched.status})",
                            code="compaction_failed")
    assert found is not None
    model = found.get("model")
    used = openai.usage_of(found) or openai.Usage(context_tokens(messages), 0, estimated=True)
    return Written(read_summary(text).text, name, model if isinstance(model, str) else None, used,
                   context_tokens(messages))


def chat_messages(body: dict[str, Any], items: list[Any]) -> list[dict[str, Any]]:
    """The conversation to summarize as chat messages (the API-neutral form): instructions, then the items."""
    view: list[dict[str, Any]] = responses.view({"instructions": body.get("instructions"), "input": items})["messages"]
    return view


def note(request: web.Request, api: str, trigger: str, written: Written, tokens_after: int) -> None:
    """The compaction on the metrics, the span and the decision trail."""
    ex = request[EXCHANGE]
    request.app[TELEMETRY].metrics.count_compaction(api, trigger, written.deployment, written.tokens_before,
                                                    tokens_after)
    ex.attributes.update({t.COMPACTION_TRIGGER: trigger, t.COMPACTION_DEPLOYMENT: written.deployment,
                          t.COMPACTION_TOKENS_BEFORE: written.tokens_before,
                          t.COMPACTION_TOKENS_AFTER: tokens_after})
    request.app[RECENT].compacted(ex.request_id, f"{trigger}: {written.deployment} summarized "
                                  f"{written.tokens_before} tokens into {tokens_after} (summary: "
                                  f"{written.usage.prompt_tokens} in, {written.usage.completion_tokens} out)")


def _sealed(request: web.Request, call: Call, written: Written, kept: list[Any]) -> tuple[dict[str, Any], int]:
    """The compaction item of a summary, and the tokens of what stands in for the conversation now."""
    after = context_tokens(chat_messages({}, [*kept, wire.summary_message(written.text)]))
    payload = wire.sealed_payload(written.text, written.deployment, written.tokens_before, after)
    return wire.compaction_item(request.app[SEAL].close(payload, call.tenant_or_anonymous)), after


async def answer(request: web.Request, call: Call, decision: Decision, trigger: str) -> web.StreamResponse:
    """v1_compact and v2_trigger: the summary is the answer, in the form the client asked for."""
    app, ex = request.app, request[EXCHANGE]
    items = wire.without_trigger(responses.input_items(call.body))
    written = await summarize(request, call, chat_messages(call.body, items), decision.attempts)
    ex.answered(written.deployment, written.model, call.policy.deployments[written.deployment].price)
    ex.settle(written.usage, app[TELEMETRY].metrics)
    kept = wire.retained(items)
    item, after = _sealed(request, call, written, kept)
    note(request, "responses", trigger, written, after)
    used = wire.usage(written.usage.prompt_tokens, written.usage.completion_tokens)
    if trigger == wire.V1_COMPACT:
        listed = [*map(wire.output_message, kept), item]
        return web.json_response(wire.compacted(responses.new_response_id(), listed, used))
    final = wire.response(call.body, responses.new_response_id(), [item], used)
    # kept as the compacted conversation: a chain onto it reads the user's messages, then the summary
    await app[CONVERSATIONS].keeper(call, {**call.body, "input": kept})(final)
    if not call.features.stream:
        return web.json_response(final)
    response = add_gateway_headers(request, web.StreamResponse(status=200, headers=STREAM_HEADERS))
    await response.prepare(request)
    await response.write(wire.stream(call.body, final["id"], item, used))
    await response.write_eof()
    return response


@dataclass(frozen=True, slots=True)
class Compacted:
    """A call whose input the gateway compacted before forwarding it (context_management)."""

    call: Call  # its body's input: the user's messages, then the summary
    decision: Decision  # its reasons say so
    adapter: Adapter  # its answer starts with the compaction item
    kept_body: dict[str, Any]  # what a chain onto its answer reads before that answer's output


async def compact_input(request: web.Request, call: Call, decision: Decision) -> Compacted | None:
    """context_management: over its threshold, the call with its input compacted (the user's messages and
    the summary); None when the call asks for none or is under its threshold."""
    threshold = wire.threshold_of(call.body)
    if threshold is None or call.features.prompt_tokens <= threshold:
        return None
    ex, policy = request[EXCHANGE], call.policy
    items = responses.input_items(call.body)
    written = await summarize(request, call, chat_messages(call.body, items),
                              decision_for(policy, wire.CONTEXT_MANAGEMENT, decision).attempts)
    ex.compacted(written.deployment, policy.deployments[written.deployment].price, written.usage,
                 request.app[TELEMETRY].metrics)
    kept = wire.retained(items)
    item, after = _sealed(request, call, written, kept)
    note(request, "responses", wire.CONTEXT_MANAGEMENT, written, after)
    body = {**call.body, "input": [*kept, wire.summary_message(written.text)]}
    compacted = Call(policy, call.endpoint, body, call.view, call.body_bytes, call.features, call.headers,
                     call.tenant, call.step, call.chain)
    reason = (f"compaction: context_management threshold {threshold} < {call.features.prompt_tokens} tokens; "
              f"{written.deployment} summarized")
    return Compacted(compacted, dataclasses.replace(decision, reasons=(*decision.reasons, reason)),
                     CompactedResponsesAdapter(item), {**call.body, "input": kept})
