"""A request's rollout arm: which arm of its route's rollout serves it (the candidate's decision swapped in on
the candidate arm), the cohort it is measured in, and, once served, its sample counted into that cohort."""

from __future__ import annotations

from gateway.decision.call import Call
from gateway.decision.routing import Context
from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment, Finish
from gateway.experiments.mirror import Mirror
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import ShadowLimits
from gateway.rollout.assignment import shadow_sampled, sticky_key
from gateway.rollout.samples import Cohort, Sample
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import Arm
from gateway.telemetry.metrics import Metrics

DEFAULT_KEY = ("header:x-session-id", "user", "api_key")  # a standing shadow's key without a rollout


class RolloutArm:
    """Puts requests on their rollout's arms, from this replica's view of the rollout states."""

    def __init__(self, rollouts: Rollouts, candidates: Candidates, mirror: Mirror, metrics: Metrics) -> None:
        self._rollouts, self._candidates, self._mirror = rollouts, candidates, mirror
        self.arms = metrics.rollout_requests

    async def assign(self, enrollment: Enrollment, spec: RolloutSpec, key: str | None, ctx: Context) -> None:
        view = self._rollouts.view
        state = view.state(spec)
        if state is None:  # no rollout running, or this replica's view is stale: stable, unmeasured
            known = view.known(spec.route or "")
            if known is not None and known.shadow_pct > 0 and not view.fresh():
                self._mirror.shadows.drop(spec.candidate, "stale_state")
            return
        arm = (await self._rollouts.arms.arm(state, key)).arm
        # A request the candidate may not serve (admission, health, context window…) stays on stable in
        # either arm, unmeasured: both cohorts then hold only requests the candidate could have taken.
        candidate = self._candidates.serving(enrollment, spec.candidate, ctx) if arm is not Arm.STABLE else None
        self.arms.labels(spec.route or "", (arm if candidate is not None else Arm.STABLE).value).inc()  # as served
        if arm is Arm.CANDIDATE and candidate is not None:
            enrollment.decision = candidate
            enrollment.candidate_deployment = _deployment_of(spec.candidate)
            enrollment.measure(spec, state, Cohort.CANDIDATE)
        elif arm is Arm.CONTROL and candidate is not None:
            enrollment.measure(spec, state, Cohort.CONTROL)
        if shadow_sampled(state, arm, key):
            samples_key = self._rollouts.counters.samples_key(state)
            self._mirror.prepare(enrollment, spec.candidate, ctx, ShadowLimits(), samples_key)

    def sample(self, enrollment: Enrollment, finish: Finish) -> None:
        """Count a served request of a measured cohort into it (a candidate call that failed over is an error)."""
        ex, spec, state, cohort = enrollment.ex, enrollment.spec, enrollment.state, enrollment.cohort
        if spec is None or state is None or cohort is None or not finish.served:
            return
        failed_over = enrollment.candidate_deployment is not None and ex.deployment != enrollment.candidate_deployment
        # a stream another deployment finished counts as a break of the arm's own deployment
        error = finish.status >= 500 or ex.error is not None or failed_over or bool(ex.parts)
        tokens = ex.usage.completion_tokens if ex.usage is not None else 0
        ttft_ms, total_ms = finish.ttft_ms, finish.total_ms
        tpot = (total_ms - ttft_ms) / (tokens - 1) if ttft_ms is not None and tokens >= 2 else None
        sample = Sample(error, enrollment.features.prompt_tokens, ttft_ms if ttft_ms is not None else total_ms, tpot)
        self._rollouts.counters.record(spec.route or "", spec, state, cohort, sample)


def request_key(chain: tuple[str, ...], call: Call) -> str | None:
    """The request's sticky key by the rollout's `key:` chain (a standing shadow's: DEFAULT_KEY)."""
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
