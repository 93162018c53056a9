"""The policy shadow: the candidate policy decides beside the live one for a share of requests; only the decision
and any disagreement are kept (nothing is sent), for `GET /admin/shadow/policy`."""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from typing import Any

from gateway.decision.routing import Context
from gateway.errors import GatewayError
from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment
from gateway.telemetry.metrics import Metrics

DISAGREEMENTS_MAX = 1000


class PolicyShadow:
    """This replica's agreement counts and its most recent disagreements."""

    def __init__(self, candidates: Candidates, metrics: Metrics) -> None:
        self._candidates = candidates
        self.disagreements: deque[dict[str, Any]] = deque(maxlen=DISAGREEMENTS_MAX)
        self.agreement: Counter[str] = Counter()
        self.decisions = metrics.policy_shadow_decisions

    def compare(self, enrollment: Enrollment, ctx: Context) -> None:
        """Decide with the candidate policy too (as sampled) and keep only the decision and any disagreement."""
        section = enrollment.policy.policy_shadow
        assert section is not None
        if section.percent < 100 and random.random() * 100 >= section.percent:
            return
        live = enrollment.decision
        try:
            found = self._candidates.policy(enrollment, section.candidate, ctx)
            got, rule = found.deployment, found.rule
        except GatewayError as exc:
            got, rule = f"error:{exc.code}", ""
        agreement = "agree" if got == live.deployment else "disagree"
        self.agreement[agreement] += 1
        self.decisions.labels(section.candidate, agreement).inc()
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
