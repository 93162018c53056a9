"""Shadow traffic from the request path: which shadows a request gets (the policy's standing shadows, a rollout's
shadow step), each prepared to start once the call is past the budget hold, and the primary's capture handed
to them when the client's answer ends. The shadows themselves run in shadows.py, never delaying the client."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from gateway.apis.routes import BY_ENDPOINT
from gateway.decision.routing import Context
from gateway.errors import GatewayError
from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment, Finish
from gateway.experiments.shadows import TRACE_HEADERS, ShadowCall, ShadowLimits, Shadows, parse_capture
from gateway.policy.model import LIVE_POLICY
from gateway.rollout.assignment import bucket
from gateway.rollout.spec import ShadowSpec


class Mirror:
    """Prepares a request's shadows; `fresh` says whether this replica's rollout view may still be trusted."""

    def __init__(self, shadows: Shadows, candidates: Candidates, fresh: Callable[[], bool]) -> None:
        self.shadows, self._candidates, self._fresh = shadows, candidates, fresh

    def standing(self, enrollment: Enrollment, specs: tuple[ShadowSpec, ...], key: str | None, ctx: Context) -> None:
        """The policy's `shadows:` of the request's route, each as sampled."""
        for spec in specs:
            if _sampled(spec, key):
                limits = ShadowLimits(spec.max_in_flight, spec.timeout_s, spec.max_tokens)
                self.prepare(enrollment, spec.target, ctx, limits)

    def prepare(
        self, enrollment: Enrollment, target: str, ctx: Context, limits: ShadowLimits, samples_key: str | None = None
    ) -> None:
        """A shadow of the request onto `target`, started by `Enrollment.sent`; a pair is counted into the
        rollout window `samples_key`, if any."""
        adapter = BY_ENDPOINT[enrollment.call.endpoint]
        if not adapter.generates:  # embeddings, count_tokens: nothing to compare
            return
        if not self._fresh():
            self.shadows.drop(target, "stale_state")  # a replica that lost the store stops shadows
            return
        kind, _, name = target.partition(":")
        body = enrollment.call.body
        if kind == "policy":
            body = _body_for(enrollment, name)
            try:
                name = self._candidates.policy(enrollment, name, ctx).deployment
            except GatewayError:
                self.shadows.drop(target, "no_decision")
                return
        if name == enrollment.decision.deployment and body is enrollment.call.body:
            self.shadows.drop(target, "same_deployment")  # the same prompt to the same deployment: nothing to learn
            return
        headers = enrollment.call.headers
        call = ShadowCall(target, name, enrollment.policy.deployments[name], adapter.path, body,
                          enrollment.ex.request_id, limits, samples_key, enrollment.features, enrollment.ex.trace,
                          {h: headers[h] for h in TRACE_HEADERS if h in headers})
        # Only a sent shadow asks for the primary's capture, which makes the relay copy the primary's bytes.
        enrollment.shadows.append(lambda: self.shadows.mirror(call, enrollment.primary))

    def finished(self, enrollment: Enrollment, finish: Finish) -> None:
        """Hand the primary's capture to the request's shadows; a call not served leaves them nothing to pair."""
        future = enrollment.future
        if future is None or future.done():
            return
        if not finish.served:
            future.cancel()
            return
        ex, stream = enrollment.ex, enrollment.features.stream
        raw = b"".join(ex.tap or ())
        future.set_result(parse_capture(finish.status, finish.total_ms, finish.ttft_ms, raw, stream, ex.deployment))


def _body_for(enrollment: Enrollment, candidate: str) -> dict[str, Any]:
    """What a shadow onto a candidate policy reads: the prompt whole (as sent) when the candidate turns the
    context rules off that made the primary's (managed against full context on the same step), else the
    primary's prompt."""
    as_sent, call = enrollment.as_sent, enrollment.call
    if as_sent is None or candidate == LIVE_POLICY:
        return call.body
    rules = enrollment.policy.candidate_policy(candidate).context_of(call.features.requested_model, call.tenant)
    off = rules.mask_tool_outputs is None and rules.summarize_old_turns is None and rules.retrieve is None
    return as_sent if off and as_sent is not call.body else call.body


def _sampled(shadow: ShadowSpec, key: str | None) -> bool:
    if shadow.percent >= 100:
        return True
    if shadow.sample_by == "key" and key is not None:
        return bucket(f"shadow/{shadow.target}", key) * 100 < shadow.percent
    return random.random() * 100 < shadow.percent
