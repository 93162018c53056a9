"""A request's part in rollouts, shadows, the policy shadow and the request log: the request path's one hook.

`Experiments.begin` runs after the live decision: the rollout arm (rollout_arm.py) may swap in the candidate's
decision, the mirror (mirror.py) prepares any shadow, the policy shadow (policy_shadow.py) decides with the
candidate policy too. `Enrollment.sent` starts the shadows once the call is past the budget hold, and
`Experiments.finished`, once the client has its answer, hands the primary's capture to the shadows, counts
the cohort sample and queues the request-log line (request_log.py). Nothing here delays or alters what the
client receives beyond choosing the rollout arm.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from gateway.classifier.scoring import Classifier
from gateway.decision.call import Call
from gateway.decision.routing import Context, Decision
from gateway.errors import CLIENT_CLOSED
from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment, Finish
from gateway.experiments.mirror import Mirror
from gateway.experiments.policy_shadow import PolicyShadow
from gateway.experiments.request_log import RequestLog, log_record
from gateway.experiments.rollout_arm import DEFAULT_KEY, RolloutArm, request_key
from gateway.experiments.rollout_counters import RolloutCounters
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import Shadows
from gateway.policy.model import Policy
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import Metrics

__all__ = ["CLIENT_CLOSED", "Enrollment", "Experiments"]


class Experiments:
    """The process's rollout arms, mirror, policy shadow and request log, composed for the request path."""

    def __init__(
        self,
        rollouts: Rollouts,
        shadows: Shadows,
        metrics: Metrics,
        request_log: RequestLog | None = None,
        classifier: Classifier | None = None,
    ) -> None:
        self.rollouts, self.shadows, self.log, self.classifier = rollouts, shadows, request_log, classifier
        candidates = Candidates(classifier)
        self.mirror = Mirror(shadows, candidates, rollouts.view.fresh)
        self.arm = RolloutArm(rollouts, candidates, self.mirror, metrics)
        self.policy_shadow = PolicyShadow(candidates, metrics)

    @property
    def cohort_counters(self) -> RolloutCounters:
        """Each rollout cohort's counters: the process figures and the outcomes its guards judge are counted here."""
        return self.rollouts.counters

    @property
    def agreement(self) -> Counter[str]:
        return self.policy_shadow.agreement

    @property
    def disagreements(self) -> deque[dict[str, Any]]:
        return self.policy_shadow.disagreements

    def engaged(self, policy: Policy) -> bool:
        return policy.experimental or self.log is not None

    async def begin(self, ex: Exchange, call: Call, ctx: Context, decision: Decision,
                    as_sent: dict[str, Any] | None = None) -> Enrollment:
        """The request's part in the experiments; `as_sent`: its body before the policy's context rules (a
        shadow onto a policy without them reads it whole)."""
        policy = call.policy
        enrollment = Enrollment(ex, call, decision, ctx.complexity, as_sent)
        if not policy.experimental:
            return enrollment
        index = self.rollouts.view.index(policy)
        route = call.features.requested_model
        spec, shadows = index.rollouts.get(route), index.shadows.get(route, ())
        key = request_key(spec.key if spec else DEFAULT_KEY, call) if spec or shadows else None
        if spec is not None:
            await self.arm.assign(enrollment, spec, key, ctx)
        self.mirror.standing(enrollment, shadows, key, ctx)
        if policy.policy_shadow is not None:
            self.policy_shadow.compare(enrollment, ctx)
        return enrollment

    def finished(self, enrollment: Enrollment, status: int) -> None:
        finish = Finish.of(enrollment, status)
        self.mirror.finished(enrollment, finish)
        self.arm.sample(enrollment, finish)
        if self.log is not None:
            self.log.write(log_record(enrollment, finish, self.log.prompts), self._later_score(enrollment))

    def _later_score(self, enrollment: Enrollment) -> Callable[[], float] | None:
        """The line's complexity when the decision read none: scored at the log's flush, not here."""
        classifier = self.classifier
        if enrollment.complexity is not None or classifier is None:
            return None
        features = enrollment.features
        return lambda: classifier.score(features)
