"""The policy shadow: the candidate policy's decision beside the live one, counted, its disagreements kept."""

from __future__ import annotations

from typing import Any

from gateway.experiments.candidates import Candidates
from gateway.experiments.policy_shadow import PolicyShadow
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of


def _policy(percent: float = 100) -> Any:
    return policy_of({"policies": {"all-hq": {"rules": [], "default": "hq"}},
                      "policy_shadow": {"candidate": "all-hq", "percent": percent}})


def test_a_disagreement_is_counted_and_kept_and_an_agreement_only_counted() -> None:
    shadow, policy = PolicyShadow(Candidates(None), make_metrics()), _policy()
    for model in ("auto", "hq"):  # live: fast by default, hq pinned; the candidate: hq for both
        enrollment, ctx = enrollment_of(call_of(policy, model))
        shadow.compare(enrollment, ctx)
    assert shadow.agreement == {"agree": 1, "disagree": 1}
    [kept] = shadow.disagreements
    assert kept["model"] == "auto" and kept["candidate"] == "all-hq"
    assert kept["live"] == {"deployment": "fast", "rule": "default"}
    assert kept["decision"] == {"deployment": "hq", "rule": "default"}
    assert shadow.decisions.labels("all-hq", "disagree")._value.get() == 1


def test_the_shadow_decides_for_its_share_of_requests() -> None:
    shadow, policy = PolicyShadow(Candidates(None), make_metrics()), _policy(percent=20)
    for _ in range(200):
        enrollment, ctx = enrollment_of(call_of(policy, "auto"))
        shadow.compare(enrollment, ctx)
    assert 0 < sum(shadow.agreement.values()) < 200
