"""Resume a stream that broke after its first byte on the next deployment in the failover order.

The policy's `resume` rule (per route, else global) allows it; resume_splice.py beside it reads back what the client was
sent, builds the continuation and splices its events into the client's stream. Here: whether to, where to, the
call to the sibling, and the record of every break (metrics, span, explain memory).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.apis.adapter import Adapter, StreamReader
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import GatewayError, UpstreamError
from gateway.features import count_tokens
from gateway.policy.model import Deployment
from gateway.server import resume_splice as resume
from gateway.server.resources import EXCHANGE, STATE
from gateway.telemetry.exchange import Resume
from gateway.upstream import forward as upstream

# the APIs whose deployments return token ids with the stream when asked (an exact resume)
_TOKEN_APIS = ("chat", "completions")
# A detokenize call decodes a few ids: one slower than this is a deployment in trouble, not a big answer.
DETOKENIZE_TIMEOUT_S = 5.0
NO_SIBLING = "no other deployment in the failover order"


@dataclass(slots=True)
class Plan:
    """How one streamed call may be resumed: `blocked` says why it may not (set before any byte streams)."""

    blocked: str | None
    left: int  # resumes left
    caps: dict[str, int] | None  # the gateway's output cap per deployment, when budgets set one
    answer_id: str
    headers: dict[str, str]
    asks_token_ids: bool
    client_wants_usage: bool = True
    sending: contextlib.ExitStack | None = None  # keeps each sibling's in-flight count while it streams
    transcript: resume.Transcript | None = None  # the stream's bytes, for a resume to read back

    def keep_transcript(self, memory: resume.TranscriptMemory, decision: Decision,
                        streaming: str) -> resume.Transcript | None:
        """The stream's transcript, its bytes taken from the process's `memory` until `close` (None: a blocked
        plan reads nothing back). `streaming`: the deployment whose stream it is; the last of the decision's
        failover order (one failed over to) has nothing after it to resume on."""
        if not _later(decision.attempts, streaming):
            self.blocked = self.blocked or NO_SIBLING
        if self.blocked is None:
            self.transcript = resume.Transcript(memory)
        return self.transcript

    def close(self) -> None:
        if self.transcript is not None:
            self.transcript.release()
        if self.sending is not None:
            self.sending.close()


def plan(adapter: Adapter, call: Call, decision: Decision, caps: Mapping[str, int] | None, answer_id: str,
         headers: dict[str, str]) -> Plan:
    """How the call's stream may be resumed. A blocked plan asks no token ids of the deployment and keeps no
    transcript: a stream that cannot be resumed costs neither."""
    rule = call.policy.resume_for(call.features.requested_model)
    blocked = None if rule.enabled else "resume is off for this route"
    if not _later(decision.attempts, decision.deployment):  # max_attempts 1, or no other one usable
        blocked = blocked or NO_SIBLING
    blocked = blocked or resume.blocked_by_request(adapter.endpoint, call.body)
    if call.body.get("return_token_ids"):
        blocked = blocked or "the client asked for token ids itself"
    return Plan(blocked, rule.max, dict(caps) if caps else None, answer_id, headers,
                asks_token_ids=blocked is None and adapter.endpoint in _TOKEN_APIS)


async def go_on(
    request: web.Request, adapter: Adapter, call: Call, decision: Decision, plan: Plan,
    progress: resume.Progress, reply: upstream.Reply, part: StreamReader | resume.Splice, err: GatewayError,
) -> tuple[upstream.Reply, resume.Splice] | Resume:
    """The sibling's continuation of a broken stream, its headers in; else the record of why there is none (not
    faithful, nowhere to go, or the sibling failed before its first byte): the caller ends the client's stream
    with the error event, saying why (`unresumed`)."""
    app, ex = request.app, request[EXCHANGE]
    state = app[STATE]
    broken = reply.deployment
    reply.close()  # a stalled deployment stops generating now, not when the continuation ends
    _count_part(progress, part)
    at = progress.generated_tokens
    if not progress.prompt_tokens:  # the prompt's ids, else (an API that reports it only at its end) the estimate
        progress.prompt_tokens = len(progress.prompt_ids) if progress.prompt_ids else ex.prompt_tokens
    target = _next(app, decision, broken)
    cap = resume.output_cap(adapter.endpoint, call.body, plan.caps.get(broken) if plan.caps else None)
    cap = cap or call.policy.deployments[broken].default_max_tokens
    why = _why_not(call, plan, progress, target, cap - at, adapter.endpoint)
    if why is None and target is not None and progress.exact:
        why = await _keep_shown_ids(app, target, call.policy.deployments[target], progress, plan.headers)
        at = progress.generated_tokens
    if why is not None or target is None:
        return _record(request, Resume(broken, None, at, "refused", why or "no deployment to resume on"))
    remaining = cap - at
    dep = call.policy.deployments[target]
    path, body = resume.continuation(progress, call.body, dep.served_model, remaining)
    ex.tried.append(target)
    if plan.sending is None:
        plan.sending = contextlib.ExitStack()
    plan.sending.enter_context(state.deployments.sending(target))
    try:
        sibling = await upstream.send(state.pool, target, dep, path, body, plan.headers)
        await upstream.answer(sibling, True, state.settings.max_upstream_body_bytes)
    except UpstreamError as exc:
        state.deployments.record_failure(target)
        return _record(request, Resume(broken, target, at, "failed", f"the continuation failed: {exc.message}"))
    plan.left -= 1
    progress.answer_id = progress.answer_id if adapter.endpoint in _TOKEN_APIS else plan.answer_id
    _record(request, Resume(broken, target, at, "resumed", err.message))
    text_of = getattr(part.streamed, "text_of", None)
    return sibling, resume.Splice(progress, plan.client_wants_usage, at, text_of)


def end_finished(request: web.Request, plan: Plan, progress: resume.Progress, reply: upstream.Reply,
                 part: StreamReader | resume.Splice) -> bytes:
    """The end of a stream whose deployment broke off after the answer's own end (its finish reason, say, and
    not the usage chunk or [DONE]): the client has the whole answer, so the gateway ends the stream, not an error."""
    reply.close()
    _count_part(progress, part)
    _record(request, Resume(reply.deployment, None, progress.generated_tokens, "ended",
                            "the answer had finished: the gateway ended its stream"))
    return resume.end_of_finished(progress, plan.client_wants_usage)


async def _keep_shown_ids(app: web.Application, target: str, dep: Deployment, progress: resume.Progress,
                          headers: dict[str, str]) -> str | None:
    """Cut the generated ids back to those whose text the client has; None, else why that could not be found.

    A sibling handed ids that end inside a character would never send the client those bytes' text: vLLM primes
    its detokenizer with the prompt, and one that ends mid-character lets out the whole prompt's text with its
    first character. Where the last event with text carried several ids, the sibling's tokenizer says which of
    them ends on a whole character."""
    state = app[STATE]
    ends = progress.shown_ends()
    for end in ends[:-1]:  # the last candidate needs no asking: some id of that event let its text out
        try:
            fetched = await upstream.fetch(state.pool, target, dep, resume.DETOKENIZE_PATH,
                                           resume.detokenize_body(progress, end, dep.served_model), headers,
                                           timeout_s=DETOKENIZE_TIMEOUT_S,
                                           limit_bytes=state.settings.max_upstream_body_bytes)
        except GatewayError as exc:
            return f"where the client's text ends could not be found: {exc.message}"
        whole = resume.ends_on_character(fetched.body) if fetched.status == 200 else None
        if whole is None:
            return f"where the client's text ends could not be found: {target} answered {fetched.status} to " \
                   f"{resume.DETOKENIZE_PATH}"
        if whole:
            progress.keep_shown(end)
            return None
    progress.keep_shown(ends[-1])
    return None


def _count_part(progress: resume.Progress, part: StreamReader | resume.Splice) -> None:
    """The tokens generated so far: the ids when the deployment returned them, else counted from the text."""
    if progress.exact:
        progress.generated_tokens = len(progress.generated_ids)
        return
    own = part.usage.completion_tokens if part.usage is not None else part.streamed.completion_tokens(count_tokens)
    progress.generated_tokens += own


def _next(app: web.Application, decision: Decision, broken: str) -> str | None:
    """The deployment after the broken one in the failover order that is not ejected."""
    load = app[STATE].deployments.load
    return next((name for name in _later(decision.attempts, broken) if name not in load or load[name].healthy),
                None)


def _later(order: tuple[str, ...], deployment: str) -> tuple[str, ...]:
    """The deployments after `deployment` in a failover order (none when it is not in it)."""
    return order[order.index(deployment) + 1:] if deployment in order else ()


def _why_not(call: Call, plan: Plan, progress: resume.Progress, target: str | None, remaining: int,
             api: str) -> str | None:
    if progress.blocked is not None:
        return progress.blocked
    if plan.left < 1:
        return "no resumes left for this request"
    if target is None:
        return "no healthy deployment after it in the failover order"
    if remaining < 1:
        return "the answer had used its whole output cap"
    window = call.policy.deployments[target].max_model_len
    if window is not None and progress.prompt_tokens + progress.generated_tokens + 1 > window:
        return f"{target} has no room left in its context window ({window} tokens)"
    if not progress.exact and not resume.resumable_text(api, call.body):
        return "the prompt is not text the continuation can extend"
    return None


def _record(request: web.Request, what: Resume) -> Resume:
    ex = request[EXCHANGE]
    ex.resumed(what)
    state = request.app[STATE]
    state.metrics.stream_resumes.labels(what.from_deployment, what.to or "none", what.outcome).inc()
    state.recent.resumed(ex.request_id, what.describe())
    return what


def unresumed(err: GatewayError, what: Resume) -> GatewayError:
    """The break's error, saying why no other deployment finished the answer: a red run or an unhappy client
    reads the cause in the error event itself, not only in the gateway's metrics."""
    said = copy.copy(err)
    said.message = f"{err.message}; not resumed: {what.reason}"
    said.args = (said.message,)
    return said


def error_event(reader: StreamReader, progress: resume.Progress | None, err: GatewayError) -> bytes:
    """The API's error event, numbered after whatever the continuation sent (the Responses API counts events)."""
    sequence: Any = getattr(reader, "sequence", None)
    if progress is not None and isinstance(sequence, int) and progress.sequence > sequence:
        reader.sequence = progress.sequence  # type: ignore[attr-defined]
    return reader.error_event(err)
