"""The request side of shadow traffic: which shadows a request gets, each waiting for the forward, and the
primary's capture handed over only for a served call."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment, Finish
from gateway.experiments.mirror import Mirror
from gateway.experiments.shadows import ShadowLimits, Shadows
from gateway.rollout.spec import ShadowSpec
from gateway.store.pairs import MemoryShadowPairStore
from gateway.telemetry.metrics import make_metrics
from gateway.upstream.client import Pool
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of


def _mirror(fresh: bool = True) -> Mirror:
    shadows = Shadows(Pool(), MemoryShadowPairStore(), make_metrics())
    return Mirror(shadows, Candidates(None), lambda: fresh)


def _dropped(mirror: Mirror, target: str, reason: str) -> float:
    value: Any = mirror.shadows.dropped.labels(target, reason)._value.get()
    return float(value)


def test_a_shadow_waits_for_the_forward() -> None:
    mirror = _mirror()
    enrollment, ctx = enrollment_of(call_of(policy_of(), "hq"))
    mirror.prepare(enrollment, "deployment:hq-v2", ctx, ShadowLimits())
    assert len(enrollment.shadows) == 1 and enrollment.future is None  # nothing sent, nothing tapped yet


def test_no_shadow_onto_the_deployment_serving_the_call_or_from_a_stale_replica() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(), "hq"))
    mirror = _mirror()
    mirror.prepare(enrollment, "deployment:hq", ctx, ShadowLimits())
    assert enrollment.shadows == [] and _dropped(mirror, "deployment:hq", "same_deployment") == 1
    stale = _mirror(fresh=False)
    stale.prepare(enrollment, "deployment:hq-v2", ctx, ShadowLimits())
    assert enrollment.shadows == [] and _dropped(stale, "deployment:hq-v2", "stale_state") == 1


def test_a_call_that_generates_nothing_is_not_shadowed() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(), "auto", endpoint="embeddings"))
    mirror = _mirror()
    mirror.prepare(enrollment, "deployment:hq-v2", ctx, ShadowLimits())
    assert enrollment.shadows == []


def test_standing_shadows_are_sampled_by_their_percent() -> None:
    enrollment, ctx = enrollment_of(call_of(policy_of(), "hq"))
    every = ShadowSpec.model_validate({"route": "hq", "target": "deployment:hq-v2", "percent": 100})
    by_key = ShadowSpec.model_validate({"route": "hq", "target": "deployment:fast", "percent": 50,
                                        "sample_by": "key"})
    mirror = _mirror()
    keys = [f"user=u{i}" for i in range(40)]
    for key in keys:
        mirror.standing(enrollment, (every, by_key), key, ctx)
    taken = len(enrollment.shadows) - len(keys)  # every request got the 100 % shadow
    assert 0 < taken < len(keys)
    again = enrollment_of(call_of(policy_of(), "hq"))[0]
    for key in keys:
        mirror.standing(again, (by_key,), key, ctx)
    assert len(again.shadows) == taken  # by key: the same keys each time


async def test_the_primary_capture_goes_to_the_shadows_only_when_served() -> None:
    mirror = _mirror()
    served, _ = enrollment_of(call_of(policy_of(), "hq"))
    unserved, _ = enrollment_of(call_of(policy_of(), "hq"))
    for enrollment in (served, unserved):
        enrollment.primary()
        enrollment.sent()
    served.ex.tap = [b'{"choices": [{"message": {"content": "hi"}}]}']
    mirror.finished(served, Finish.of(served, 200))
    mirror.finished(unserved, Finish.of(unserved, 400))
    assert _result(served).status == 200 and _result(served).body is not None
    assert unserved.future is not None and unserved.future.cancelled()


def _result(enrollment: Enrollment) -> Any:
    future = enrollment.future
    assert isinstance(future, asyncio.Future) and future.done()
    return future.result()
