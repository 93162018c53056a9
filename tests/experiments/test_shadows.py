"""The shadow runtime's pure helpers: the body a shadow is sent, and the breaker that stops a failing target."""

from __future__ import annotations

from gateway.experiments.shadows import BREAKER_FAILURES, Breaker, shadow_body


def test_shadow_body_strips_state_and_caps_tokens() -> None:
    body = {
        "model": "m",
        "messages": [],
        "store": True,
        "metadata": {"a": 1},
        "max_tokens": 4000,
        "max_completion_tokens": 10,
        "stream": True,
        "previous_response_id": "x",
    }
    out = shadow_body(body, 256)
    assert out == {
        "model": "m",
        "messages": [],
        "max_tokens": 256,
        "max_completion_tokens": 10,
        "stream": True,
    }
    assert shadow_body({"model": "m"}, 64)["max_tokens"] == 64


def test_breaker_opens_after_failures_then_lets_one_probe_through() -> None:
    breaker = Breaker()
    for _ in range(BREAKER_FAILURES):
        assert breaker.allows(0.0)
        breaker.record(False, 0.0)
    assert not breaker.allows(1.0)
    assert breaker.allows(100.0) and not breaker.allows(100.0)  # half-open: a single probe
    breaker.record(True, 100.0)
    assert breaker.allows(100.0)
