"""A session's outcome as data: the API body and the header read strictly, mixes, ids, the figures table."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.agents import outcomes as oc
from gateway.errors import BadRequest


def test_a_full_body_is_read_and_round_trips() -> None:
    found = oc.read_body({"success": False, "score": 0.25, "reason": "tests fail", "labels": {"task": "t-7"}})
    assert (found.success, found.score, found.reason) == (False, 0.25, "tests fail")
    assert dict(found.labels) == {"task": "t-7"}
    assert oc.read_body({"success": True}).score is None
    again = oc.Outcome.from_dict({**found.to_dict(), "rollout": "r\t0\t1\tcandidate"})
    assert again == oc.Outcome(False, 0.25, "tests fail", {"task": "t-7"}, rollout="r\t0\t1\tcandidate")
    assert '"rollout"' in found.encode() and "rollout" not in found.to_dict()  # kept, never shown


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({}, "success"),
    ({"success": "yes"}, "success"),
    ({"success": 1}, "success"),
    ({"success": True, "score": 1.5}, "score"),
    ({"success": True, "score": True}, "score"),
    ({"success": True, "score": "0.5"}, "score"),
    ({"success": True, "reason": 3}, "reason"),
    ({"success": True, "reason": "x" * (oc.REASON_MAX_CHARS + 1)}, "reason"),
    ({"success": True, "labels": ["a"]}, "labels"),
    ({"success": True, "labels": {"a": 1}}, "labels"),
    ({"success": True, "labels": {"": "v"}}, "labels"),
    ({"success": True, "labels": {f"k{i}": "v" for i in range(oc.LABELS_MAX + 1)}}, "labels"),
    ({"success": True, "passed": True}, "passed"),
])
def test_bad_bodies_are_refused_naming_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as caught:
        oc.read_body(body)
    assert caught.value.envelope()["error"]["param"] == param


def test_the_header_reads_success_or_failure_and_nothing_else() -> None:
    assert oc.read_header({}) is None
    assert oc.read_header({oc.HEADER: "success"}) is True and oc.read_header({oc.HEADER: " Failure "}) is False
    with pytest.raises(BadRequest, match="success or failure"):
        oc.read_header({oc.HEADER: "passed"})


def test_mix_names_the_deployments_used_and_stays_bounded() -> None:
    assert oc.mix({"hq": 2, "fast": 5}) == "fast+hq" and oc.mix({"fast": 3, "hq": 0}) == "fast"
    assert oc.mix({}) == "none" and oc.mix({"a": 1, "b": 1, "c": 1, "d": 1}) == "mixed"


def test_membership_round_trips_and_refuses_garbage() -> None:
    m = oc.Membership("hq-v2", 1, 3, "control")
    assert oc.Membership.decode(m.encode()) == m
    assert oc.Membership.decode("nonsense") is None and oc.Membership.decode("a\tx\t1\tcandidate") is None


def test_the_figures_charge_failures_to_the_successes() -> None:
    ok, failed = oc.Outcome(True, cost_usd=0.01, steps=4), oc.Outcome(False, cost_usd=0.03, steps=9)
    table = oc.rows([("auto", "fast", "none", ok), ("auto", "fast", "none", failed), ("auto", "hq", "none", ok)])
    first = table[0].to_dict()
    assert (first["mix"], first["sessions"], first["successes"], first["success_rate"]) == ("fast", 2, 1, 0.5)
    assert first["cost_per_session_usd"] == pytest.approx(0.02)
    assert first["cost_per_success_usd"] == pytest.approx(0.04)  # the failed run's spend counts too
    assert first["cost_per_successful_session_usd"] == pytest.approx(0.01) and first["steps_per_success"] == 4
    empty = oc.OutcomeRow("auto", "hq", "none").to_dict()
    assert empty["success_rate"] is None and empty["cost_per_success_usd"] is None
