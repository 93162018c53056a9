"""Validation of the rollout and shadow sections of the policy YAML."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from gateway.rollout.spec import RolloutSpec, ShadowSpec, check_route, problems
from tests.fixtures.rollout_scripts import spec_of

EXAMPLE = """
id: hq-v2-2025-11
route: auto
candidate: deployment:hq-v2
stable: deployment:hq
key: [header:x-session-id, user, api_key]
max_hold_s: 1800
guards:
  error_rate: {slo: 0.02, margin: 0.02}
  ttft_p95: {margin: 0.05}
  tpot_p95: {margin: 0.05}
  shadow_quality: {margin: 0.05}
steps:
  - shadow: {percent: 10}
  - pause: {duration_s: 600, until: {min_samples: 200}}
  - set_weight: 10
  - pause: {duration_s: 300, until: {min_samples: 200}}
  - analysis: {guards: [error_rate, ttft_p95], min_samples: 100}
  - set_weight: 25
  - pause: {}
  - set_weight: 50
  - pause: {duration_s: 300}
  - set_weight: 100
"""


def test_the_documented_example_loads() -> None:
    spec = RolloutSpec.model_validate(yaml.safe_load(EXAMPLE))
    assert len(spec.steps) == 10 and spec.guards.ttft_p95 is not None
    with pytest.raises(ValidationError):
        spec.max_hold_s = 5  # frozen


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("[{set_weight: 0}]", "steps[0].set_weight: set_weight must be in (0, 100], got 0"),
        ("[{set_weight: 150}]", "set_weight must be in (0, 100], got 150"),
        (
            "[{set_weight: 50}, {set_weight: 20}]",
            "steps[1]: set_weight 20 must be above the previous weight 50",
        ),
        ("[{canary: 5}]", "steps[0]: {'canary': 5} is not a step; each step is exactly one of"),
        ("[{set_weight: 5, pause: {}}]", "is not a step"),
        (
            "[{pause: {duration_s: 10, forever: true}}]",
            "steps[0].pause.forever: Extra inputs are not permitted",
        ),
        ("[{set_weight: 100}, {analysis: {}}]", "steps[1]: an analysis or timed pause after set_weight 100"),
        ("[]", "at least 1 item"),
    ],
)
def test_misconfigured_steps_are_named(steps: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        spec_of(f"steps: {steps}")
    assert message in str(caught.value)


def test_other_misconfigurations() -> None:
    with pytest.raises(ValidationError, match="is the stable target itself"):
        spec_of("steps: [{set_weight: 5}]", stable="deployment:hq-v2")
    with pytest.raises(ValidationError, match="must be 'deployment:NAME' or 'policy:NAME'"):
        spec_of("steps: [{set_weight: 5}]", candidate="hq-v2")
    with pytest.raises(ValidationError, match="key source 'cookie' must be"):
        spec_of("steps: [{set_weight: 5}]", key=["cookie"])
    with pytest.raises(ValidationError, match=r"interim_alpha 0\.1 must not exceed alpha 0\.05"):
        spec_of("steps: [{set_weight: 5}]", interim_alpha=0.1)
    with pytest.raises(ValidationError, match="Extra inputs"):
        spec_of("steps: [{set_weight: 5}]", weight=5)


def test_route_level_checks() -> None:
    a = spec_of("steps: [{set_weight: 5}]", route="auto")
    b = spec_of(
        "steps: [{set_weight: 5}]", id="other", route="auto", candidate="policy:router-v2", stable=None
    )
    stable_of = {"auto": "policy:live", "hq": "deployment:hq"}
    found = list(problems([a, b], stable_of=stable_of, deployments={"hq", "hq-v2"}, policies={"router-v2"}))
    assert found == [
        "rollouts[0].stable: 'deployment:hq' but route 'auto' is served by 'policy:live'",
        "rollouts: route 'auto' has 2 rollouts (items [0, 1]); at most one per route",
    ]
    mirror = ShadowSpec(target="deployment:hq", route="hq", percent=5)
    ghost = ShadowSpec(target="deployment:nope", route="chat", percent=5)
    found = list(problems([], [mirror, ghost], stable_of=stable_of, deployments={"hq"}))
    assert found == [
        "shadows[0]: 'deployment:hq' is the stable target of route 'hq': a shadow or rollout onto itself",
        "shadows[1].route: unknown route 'chat' (known: ['auto', 'hq'])",
        "shadows[1]: unknown deployment 'nope' (known: ['hq'])",
    ]
    with pytest.raises(ValueError, match="at most one rollout per route, found 2"):
        check_route("auto", "policy:live", [a, b])
    with pytest.raises(ValueError, match="shadow of the stable target 'deployment:hq' onto itself"):
        check_route("hq", "deployment:hq", [], [mirror])
