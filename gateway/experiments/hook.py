"""A request's part in rollouts, shadows, the policy shadow and the request log: the request path's one hook.

`Experiments.begin` runs after the live decision (it may swap in the candidate's decision and prepares any
shadow), `Enrollment.sent` starts the shadows once the call is past the budget hold, and `Experiments.finished`,
once the client has its answer, records the cohort sample, hands the primary's capture to the shadows and
queues the request-log line. Nothing here delays or
alters what the client receives beyond choosing the rollout arm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.apis.routes import BY_ENDPOINT
from gateway.classifier.scoring import Classifier
from gateway.decision.call import Call
from gateway.decision.routing import Context, Decision, decide, substitute
from gateway.errors import GatewayError
from gateway.experiments.agent_steps import Cohorted
from gateway.experiments.request_log import RequestLog, loggable_headers
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import ShadowLimits, Shadows, parse_capture
from gateway.features import Features
from gateway.policy.model import Policy
from gateway.rollout.assignment import bucket, shadow_sampled, sticky_key
from gateway.rollout.comparison import Capture
from gateway.rollout.samples import Cohort, Sample
from gateway.rollout.spec import RolloutSpec, ShadowSpec
from gateway.rollout.state import Arm, RolloutState
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import COMPLEXITY, Metrics

CLIENT_CLOSED = 499
DISAGREEMENTS_MAX = 1000
DEFAULT_KEY = ("header:x-session-id", "user", "api_key")


class Experiments:
    """The process's rollouts, shadows, policy-shadow record and request log, for the request path."""

    def __init__(
        self,
        rollouts: Rollouts,
        shadows: Shadows,
        metrics: Metrics,
        request_log: RequestLog | None = None,
        classifier: Classifier | None = None,
    ) -> None:
        self.rollouts, self.shadows, self.log, self.classifier = rollouts, shadows, request_log, classifier
        self.disagreements: deque[dict[str, Any]] = deque(maxlen=DISAGREEMENTS_MAX)
        self.agreement: Counter[str] = Counter()
        self.policy_decisions, self.arms = metrics.policy_shadow_decisions, metrics.rollout_requests

    def engaged(self, policy: Policy) -> bool:
        return policy.experimental or self.log is not None

    async def begin(self, ex: Exchange, call: Call, ctx: Context, decision: Decision) -> Enrollment:
        policy, features = call.policy, call.features
        enrollment = Enrollment(ex, call, decision)
        if not policy.experimental:
            return enrollment
        route = features.requested_model
        index = self.rollouts.index(policy)
        spec, shadows = index.rollouts.get(route), index.shadows.get(route, ())
        key = _key(spec.key if spec else DEFAULT_KEY, call) if spec or shadows else None
        if spec is not None:
            await self._rollout(enrollment, spec, key, ctx)
        for shadow in shadows:
            if _sampled(shadow, key):
                self._mirror(
                    enrollment,
                    shadow.target,
                    ctx,
                    ShadowLimits(shadow.max_in_flight, shadow.timeout_s, shadow.max_tokens),
                )
        if policy.policy_shadow is not None:
            self._shadow_policy(enrollment, ctx)
        return enrollment

    async def _rollout(self, enrollment: Enrollment, spec: RolloutSpec, key: str | None, ctx: Context) -> None:
        state = self.rollouts.state(spec)
        if state is None:  # no rollout running, or this replica's view is stale: stable, unmeasured
            known = self.rollouts.view.known(spec.route or "")
            if known is not None and known.shadow_pct > 0 and not self.rollouts.fresh():
                self.shadows.drop(spec.candidate, "stale_state")
            return
        arm = (await self.rollouts.arm(state, key)).arm
        # A request the candidate may not serve (admission, health, context window…) stays on stable in
        # either arm, unmeasured: both cohorts then hold only requests the candidate could have taken.
        candidate = self._candidate(enrollment, spec.candidate, ctx) if arm is not Arm.STABLE else None
        self.arms.labels(spec.route or "", (arm if candidate is not None else Arm.STABLE).value).inc()  # as served
        if arm is Arm.CANDIDATE and candidate is not None:
            enrollment.decision = candidate
            enrollment.candidate_deployment = _deployment_of(spec.candidate)
            enrollment.measure(spec, state, Cohort.CANDIDATE)
        elif arm is Arm.CONTROL and candidate is not None:
            enrollment.measure(spec, state, Cohort.CONTROL)
        if shadow_sampled(state, arm, key):
            self._mirror(enrollment, spec.candidate, ctx, ShadowLimits(), self.rollouts.samples_key(state))

    def _candidate(self, enrollment: Enrollment, target: str, ctx: Context) -> Decision | None:
        """The candidate's decision for this request, or None when the candidate may not serve it."""
        kind, _, name = target.partition(":")
        if kind == "policy":
            try:
                found = self._decide_candidate(enrollment, name, ctx)
            except GatewayError:
                return None
            return Decision(found.deployment, f"{target}/{found.rule}", found.attempts, found.reasons)
        return substitute(enrollment.policy, enrollment.features, ctx, enrollment.decision, name)

    def _decide_candidate(self, enrollment: Enrollment, name: str, ctx: Context) -> Decision:
        """The candidate policy's decision, its complexity scored by its own classifier when that differs."""
        candidate = enrollment.policy.candidate_policy(name)
        scored = self._candidate_context(enrollment, candidate, ctx)
        found = decide(candidate, enrollment.features, scored)
        if scored is not ctx and scored.complexity is not None:
            note = f"complexity {scored.complexity:.4f} from policy:{name}'s classifier"
            found = Decision(found.deployment, found.rule, found.attempts, (note, *found.reasons))
        return found

    def _candidate_context(self, enrollment: Enrollment, candidate: Policy, ctx: Context) -> Context:
        if self.classifier is None or not candidate.reads_complexity:
            return ctx
        live = enrollment.policy.classifier_or(self.classifier)
        model = candidate.classifier_or(self.classifier)
        if model is live and ctx.complexity is not None:
            return ctx
        # The route's live share thresholds follow the live model's scores; another model's scores are
        # compared with the thresholds of its own calibration (the cold-start ones) instead.
        thresholds = ctx.share_thresholds if model is live else {}
        return replace(ctx, complexity=model.score(enrollment.features), share_thresholds=thresholds)

    def _mirror(
        self, enrollment: Enrollment, target: str, ctx: Context, limits: ShadowLimits, samples_key: str | None = None
    ) -> None:
        adapter = BY_ENDPOINT[enrollment.call.endpoint]
        if not adapter.generates:  # embeddings, count_tokens: nothing to compare
            return
        if not self.rollouts.fresh():
            self.shadows.drop(target, "stale_state")  # a replica that lost the store stops shadows
            return
        kind, _, name = target.partition(":")
        if kind == "policy":
            try:
                name = self._decide_candidate(enrollment, name, ctx).deployment
            except GatewayError:
                self.shadows.drop(target, "no_decision")
                return
        if name == enrollment.decision.deployment:
            self.shadows.drop(target, "same_deployment")
            return
        dep, path = enrollment.policy.deployments[name], adapter.path
        enrollment.shadows.append(
            lambda: self.shadows.mirror(
                target,
                name,
                dep,
                path,
                enrollment.call.body,
                enrollment.ex.request_id,
                limits,
                enrollment.primary,  # only a sent shadow makes the relay copy the primary's bytes
                samples_key,
                enrollment.features,
            )
        )

    def _shadow_policy(self, enrollment: Enrollment, ctx: Context) -> None:
        """Decide with the candidate policy too and keep only the decision and any disagreement."""
        section = enrollment.policy.policy_shadow
        assert section is not None
        if section.percent < 100 and random.random() * 100 >= section.percent:
            return
        live = enrollment.decision
        try:
            found = self._decide_candidate(enrollment, section.candidate, ctx)
            got, rule = found.deployment, found.rule
        except GatewayError as exc:
            got, rule = f"error:{exc.code}", ""
        agreement = "agree" if got == live.deployment else "disagree"
        self.agreement[agreement] += 1
        self.policy_decisions.labels(section.candidate, agreement).inc()
        if agreement == "disagree":
            self.disagreements.append(
                {
                    "at": round(time.time(), 3),
                    "request_id": enrollment.ex.request_id,
                    "model": enrollment.features.requested_model,
                    "candidate": section.candidate,
                    "live": {"deployment": live.deployment, "rule": live.rule},
                    "decision": {"deployment": got, "rule": rule},
                }
            )

    def finished(self, enrollment: Enrollment, status: int) -> None:
        ex = enrollment.ex
        total_ms = (time.perf_counter() - ex.started) * 1000
        ttft_ms = None if ex.first_byte_at is None else (ex.first_byte_at - ex.started) * 1000
        # Only a call a deployment served is a sample or a pair: not one refused before the forward (429,
        # 503), not a 4xx (the request's own fault), not one whose client left.
        served = enrollment.forwarded and status != CLIENT_CLOSED and not 400 <= status < 500
        if enrollment.future is not None and not enrollment.future.done():
            if not served:
                enrollment.future.cancel()
            else:
                raw = b"".join(ex.tap or ())
                enrollment.future.set_result(
                    parse_capture(status, total_ms, ttft_ms, raw, enrollment.features.stream, ex.deployment))
        if enrollment.cohort is not None and served:
            self._sample(enrollment, status, total_ms, ttft_ms)
        if self.log is not None:
            self.log.write(self._log_record(enrollment, status, total_ms, ttft_ms))

    def _sample(self, enrollment: Enrollment, status: int, total_ms: float, ttft_ms: float | None) -> None:
        ex, spec, state, cohort = enrollment.ex, enrollment.spec, enrollment.state, enrollment.cohort
        assert spec is not None and state is not None and cohort is not None
        failed_over = enrollment.candidate_deployment is not None and ex.deployment != enrollment.candidate_deployment
        error = status >= 500 or ex.error is not None or failed_over
        tokens = ex.usage.completion_tokens if ex.usage is not None else 0
        tpot = (total_ms - ttft_ms) / (tokens - 1) if ttft_ms is not None and tokens >= 2 else None
        sample = Sample(
            error, enrollment.features.prompt_tokens, ttft_ms if ttft_ms is not None else total_ms, tpot
        )
        self.rollouts.record(spec.route or "", spec, state, cohort, sample)

    def _log_record(
        self, enrollment: Enrollment, status: int, total_ms: float, ttft_ms: float | None
    ) -> dict[str, Any]:
        ex, f, d = enrollment.ex, enrollment.features, enrollment.decision
        features = {k: getattr(f, k) for k in f.__slots__ if k != "last_user_text" or self.log_prompts}
        complexity = ex.attributes.get(COMPLEXITY)
        if complexity is None and self.classifier is not None:
            complexity = self.classifier.score(f)
        usage = ex.usage
        price = (
            enrollment.policy.deployments[ex.deployment].price
            if ex.deployment in enrollment.policy.deployments
            else None
        )
        record: dict[str, Any] = {
            "at": round(time.time(), 3),
            "request_id": ex.request_id,
            "endpoint": f.endpoint,
            "model": f.requested_model,
            "tenant": enrollment.call.tenant,
            "headers": loggable_headers(enrollment.call.headers, enrollment.policy.read_headers),
            "features": features,
            "step": None if enrollment.call.step is None else dataclasses.asdict(enrollment.call.step),
            "complexity": complexity,
            "decision": {"deployment": d.deployment, "rule": d.rule, "attempts": list(d.attempts)},
            "served_by": ex.deployment,
            "arm": enrollment.cohort.value if enrollment.cohort else None,
            "status": status,
            "usage": None
            if usage is None
            else {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens},
            "cost_usd": None
            if usage is None or price is None
            else price.cost_usd(usage.prompt_tokens, usage.completion_tokens),
            "latency_ms": round(total_ms, 3),
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
        }
        if self.log_prompts:
            record["body"] = enrollment.call.body
        return record

    @property
    def log_prompts(self) -> bool:
        return self.log is not None and self.log.prompts


class Enrollment:
    """One request's part in the experiments: its arm, cohort and shadow rendezvous."""

    __slots__ = ("call", "candidate_deployment", "cohort", "decision", "ex", "forwarded", "future", "shadows",
                 "spec", "state")

    def __init__(self, ex: Exchange, call: Call, decision: Decision) -> None:
        self.ex, self.call, self.decision = ex, call, decision
        self.spec: RolloutSpec | None = None
        self.state: RolloutState | None = None
        self.cohort: Cohort | None = None
        self.candidate_deployment: str | None = None
        self.future: asyncio.Future[Capture] | None = None
        self.shadows: list[Callable[[], bool]] = []  # started once the call passes admission to a deployment
        self.forwarded = False

    def measure(self, spec: RolloutSpec, state: RolloutState, cohort: Cohort) -> None:
        self.spec, self.state, self.cohort = spec, state, cohort

    def cohorted(self) -> Cohorted | None:
        """The measured cohort, for the agent step's process counters; None outside one."""
        if self.spec is None or self.state is None or self.cohort is None:
            return None
        return Cohorted(self.spec.route or "", self.spec, self.state, self.cohort)

    def primary(self) -> asyncio.Future[Capture]:
        """The primary's capture, resolved when the client's response ends; the relay starts copying bytes."""
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()
            self.ex.tap = []
        return self.future

    @property
    def policy(self) -> Policy:
        return self.call.policy

    @property
    def features(self) -> Features:
        return self.call.features

    def sent(self) -> None:
        """The call is past the budget hold, on its way to a deployment: its shadows start now, so a call refused
        there is neither shadowed nor sampled."""
        self.forwarded = True
        for start in self.shadows:
            start()
        self.shadows.clear()


def _key(chain: tuple[str, ...], call: Call) -> str | None:
    auth = call.headers.get("authorization") or call.headers.get("x-api-key") or ""
    user = call.view.get("user")
    return sticky_key(
        chain,
        headers=call.headers,
        user=user if isinstance(user, str) else None,
        api_key=auth.removeprefix("Bearer ").strip() or None,
        tenant=call.tenant,
        session=call.session_id if "session" in chain else None,
    )


def _deployment_of(target: str) -> str | None:
    kind, _, name = target.partition(":")
    return name if kind == "deployment" else None


def _sampled(shadow: ShadowSpec, key: str | None) -> bool:
    if shadow.percent >= 100:
        return True
    if shadow.sample_by == "key" and key is not None:
        return bucket(f"shadow/{shadow.target}", key) * 100 < shadow.percent
    return random.random() * 100 < shadow.percent
