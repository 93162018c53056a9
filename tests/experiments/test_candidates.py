"""A candidate's decision beside the live one: a deployment target takes the live decision's place, a policy
target decides with the candidate policy, and a candidate that cannot serve the request has no decision."""

from __future__ import annotations

from gateway.experiments.candidates import Candidates
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of

CANDIDATE = {"policies": {"all-hq": {"rules": [], "default": "hq"}}}


def test_a_deployment_candidate_replaces_the_live_deployment() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(), "hq"))
    found = Candidates(None).serving(enrollment, "deployment:hq-v2", ctx)
    assert found is not None and found.deployment == "hq-v2"


def test_a_policy_candidate_decides_with_its_own_rules() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(CANDIDATE), "auto"))
    assert enrollment.decision.deployment == "fast"  # the live default
    found = Candidates(None).serving(enrollment, "policy:all-hq", ctx)
    assert found is not None and (found.deployment, found.rule) == ("hq", "policy:all-hq/default")
    assert Candidates(None).policy(enrollment, "all-hq", ctx).rule == "default"


def test_a_candidate_that_cannot_serve_the_request_has_no_decision() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(), "auto", endpoint="embeddings"))
    assert enrollment.decision.deployment == "fast"
    assert Candidates(None).serving(enrollment, "deployment:hq-v2", ctx) is None  # it serves no embeddings
