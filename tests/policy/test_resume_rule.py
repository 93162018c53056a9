"""The policy's `resume` rule: on by default, per route or global, validated."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.policy.model import Policy


def _policy(**extra: Any) -> dict[str, Any]:
    routes = extra.pop("models", {"auto": {"route": "rules"}, "fast": {"pin": "fast"}})
    return {"deployments": {"fast": {"url": "http://127.0.0.1:1", "served_model": "f"},
                            "hq": {"url": "http://127.0.0.1:2", "served_model": "h"}},
            "models": routes, "default": "fast", **extra}


def test_resume_is_on_by_default_once_per_request() -> None:
    rule = Policy.model_validate(_policy()).resume_for("auto")
    assert rule.enabled and rule.max == 1


def test_a_route_overrides_the_global_rule() -> None:
    policy = Policy.model_validate(_policy(resume={"max": 2}, models={
        "auto": {"route": "rules"}, "fast": {"pin": "fast", "resume": {"enabled": False}}}))
    assert not policy.resume_for("fast").enabled
    assert policy.resume_for("auto").enabled and policy.resume_for("auto").max == 2


@pytest.mark.parametrize("rule", [{"max": 0}, {"max": 9}, {"enabled": "sometimes"}, {"tries": 1}])
def test_a_bad_resume_rule_is_refused_naming_the_field(rule: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as caught:
        Policy.model_validate(_policy(resume=rule))
    assert "resume" in str(caught.value)
