"""A candidate's decision for a request (a rollout's candidate arm, a shadow's `policy:` target, the policy shadow),
its complexity scored by the candidate's own classifier when that differs from the live one's."""

from __future__ import annotations

from dataclasses import replace

from gateway.classifier.scoring import Classifier
from gateway.decision.routing import Context, Decision, decide, substitute
from gateway.errors import GatewayError
from gateway.experiments.enrollment import Enrollment
from gateway.policy.model import Policy


class Candidates:
    """Decides for candidates beside the live decision; `classifier` is the process's default model."""

    def __init__(self, classifier: Classifier | None) -> None:
        self.classifier = classifier

    def serving(self, enrollment: Enrollment, target: str, ctx: Context) -> Decision | None:
        """The candidate target's decision for this request, or None when the candidate may not serve it."""
        kind, _, name = target.partition(":")
        if kind == "policy":
            try:
                found = self.policy(enrollment, name, ctx)
            except GatewayError:
                return None
            return Decision(found.deployment, f"{target}/{found.rule}", found.attempts, found.reasons)
        return substitute(enrollment.policy, enrollment.features, ctx, enrollment.decision, name)

    def policy(self, enrollment: Enrollment, name: str, ctx: Context) -> Decision:
        """The candidate policy's decision (GatewayError when it has none), its complexity scored by its own
        classifier when that differs."""
        candidate = enrollment.policy.candidate_policy(name)
        scored = self._context(enrollment, candidate, ctx)
        found = decide(candidate, enrollment.features, scored)
        if scored is not ctx and scored.complexity is not None:
            note = f"complexity {scored.complexity:.4f} from policy:{name}'s classifier"
            found = Decision(found.deployment, found.rule, found.attempts, (note, *found.reasons))
        return found

    def _context(self, enrollment: Enrollment, candidate: Policy, ctx: Context) -> Context:
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
