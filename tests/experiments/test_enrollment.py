"""One request's enrollment: its shadows start only once the call is on its way, and only a call a deployment
served counts as served."""

from __future__ import annotations

import pytest

from gateway.experiments.enrollment import CLIENT_CLOSED, Finish
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of


@pytest.mark.parametrize(
    ("forwarded", "status", "served"),
    [(True, 200, True), (True, 502, True), (True, 400, False), (True, CLIENT_CLOSED, False), (False, 429, False),
     (False, 200, False)],
)
def test_only_a_call_a_deployment_answered_is_served(forwarded: bool, status: int, served: bool) -> None:
    enrollment, _ = enrollment_of(call_of(policy_of()))
    enrollment.forwarded = forwarded
    finish = Finish.of(enrollment, status)
    assert (finish.status, finish.served) == (status, served)
    assert finish.total_ms >= 0 and finish.ttft_ms is None  # no first byte seen


def test_the_shadows_start_once_when_the_call_is_sent() -> None:
    enrollment, _ = enrollment_of(call_of(policy_of()))
    started: list[int] = []
    enrollment.shadows.append(lambda: started.append(1) is None)
    assert started == [] and not enrollment.forwarded
    enrollment.sent()
    enrollment.sent()
    assert started == [1] and enrollment.forwarded


async def test_the_primary_capture_is_asked_for_once_and_taps_the_relay() -> None:
    enrollment, _ = enrollment_of(call_of(policy_of()))
    assert enrollment.ex.tap is None and enrollment.cohorted() is None
    future = enrollment.primary()
    assert enrollment.primary() is future and enrollment.ex.tap == []
