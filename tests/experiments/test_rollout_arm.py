"""A request's rollout arm: the candidate arm is served by the candidate and measured, a request the candidate
cannot serve stays stable and unmeasured, and only a served request is counted into its cohort."""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.experiments.candidates import Candidates
from gateway.experiments.enrollment import Enrollment, Finish
from gateway.experiments.mirror import Mirror
from gateway.experiments.rollout_arm import DEFAULT_KEY, RolloutArm, request_key
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import Shadows
from gateway.policy.model import Policy
from gateway.rollout.samples import Cohort
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.rollout.step import start
from gateway.store.pairs import MemoryShadowPairStore
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.telemetry.metrics import make_metrics
from gateway.upstream.client import Pool
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of

ROLLOUT = {"rollouts": [{"id": "r1", "route": "hq", "candidate": "deployment:hq-v2", "stable": "deployment:hq",
                         "steps": [{"set_weight": 100}]}]}


async def _arm(weight_pct: float) -> tuple[RolloutArm, Rollouts, Policy, RolloutSpec, RolloutState]:
    policy, store, metrics = policy_of(ROLLOUT), MemoryRolloutStore(), make_metrics()
    rollouts = Rollouts(store, lambda: policy, metrics)
    spec = rollouts.view.index(policy).rollouts["hq"]
    state = dataclasses.replace(start("r1", 0.0), weight_pct=weight_pct)
    await store.write_state("hq", -1, state, 0)
    await rollouts.view.refresh()
    candidates = Candidates(None)
    mirror = Mirror(Shadows(Pool(), MemoryShadowPairStore(), metrics), candidates, rollouts.view.fresh)
    return RolloutArm(rollouts, candidates, mirror, metrics), rollouts, policy, spec, state


def _served(arm: RolloutArm, arm_name: str) -> Any:
    return arm.arms.labels("hq", arm_name)._value.get()


async def test_the_candidate_arm_is_served_by_the_candidate_and_measured() -> None:
    arm, _, policy, spec, state = await _arm(100.0)
    enrollment, ctx = enrollment_of(call_of(policy, "hq"))
    await arm.assign(enrollment, spec, "user=alice", ctx)
    assert enrollment.decision.deployment == "hq-v2" and enrollment.candidate_deployment == "hq-v2"
    assert (enrollment.cohort, enrollment.state) == (Cohort.CANDIDATE, state)
    assert _served(arm, "candidate") == 1


async def test_a_request_the_candidate_cannot_serve_stays_stable_and_unmeasured() -> None:
    arm, _, policy, spec, _ = await _arm(100.0)
    enrollment, ctx = _embeddings_on_hq(policy)
    await arm.assign(enrollment, spec, "user=alice", ctx)
    assert enrollment.cohort is None and enrollment.decision.deployment != "hq-v2"
    assert (_served(arm, "candidate"), _served(arm, "stable")) == (0, 1)


def _embeddings_on_hq(policy: Policy) -> tuple[Enrollment, Any]:
    """A call the candidate may not take: hq-v2 serves no embeddings (the live decision sends them to fast)."""
    return enrollment_of(call_of(policy, "auto", endpoint="embeddings"))


async def test_a_stale_view_serves_stable() -> None:
    arm, rollouts, policy, spec, _ = await _arm(100.0)
    rollouts.view.synced_at = float("-inf")
    enrollment, ctx = enrollment_of(call_of(policy, "hq"))
    await arm.assign(enrollment, spec, "user=alice", ctx)
    assert enrollment.decision.deployment == "hq" and enrollment.cohort is None


async def test_only_a_served_request_is_counted_and_a_failover_counts_as_an_error() -> None:
    arm, rollouts, policy, spec, state = await _arm(100.0)
    counted = []
    for status, answered_by in ((200, "hq-v2"), (200, "hq"), (429, None)):
        enrollment, ctx = enrollment_of(call_of(policy, "hq"))
        await arm.assign(enrollment, spec, "user=alice", ctx)
        enrollment.forwarded = answered_by is not None
        enrollment.ex.deployment = answered_by or ""
        arm.sample(enrollment, Finish.of(enrollment, status))
        await rollouts.flush()
        obs = await rollouts.counters.observe(state)
        counted.append((obs.candidate.requests, obs.candidate.errors))
    assert counted == [(1, 0), (2, 1), (2, 1)]  # the failed-over one is an error; the refused one not counted


def test_the_sticky_key_follows_the_chain() -> None:
    call = call_of(policy_of(), "hq", headers={"x-session-id": "s-1"}, user="alice")
    assert request_key(DEFAULT_KEY, call) == "header:x-session-id=s-1"
    assert request_key(("user",), call) == "user=alice"


async def test_a_call_whose_stream_another_deployment_finished_is_an_error_of_its_arm() -> None:
    from gateway.apis.usage import Usage

    arm, rollouts, policy, spec, state = await _arm(100.0)
    enrollment, ctx = enrollment_of(call_of(policy, "hq"))
    await arm.assign(enrollment, spec, "user=alice", ctx)
    enrollment.forwarded = True
    enrollment.ex.deployment = "hq-v2"
    enrollment.ex.parts = [("hq-v2", None, Usage(11, 4))]  # it broke mid-answer; a resume finished the stream
    arm.sample(enrollment, Finish.of(enrollment, 200))
    await rollouts.flush()
    obs = await rollouts.counters.observe(state)
    assert (obs.candidate.requests, obs.candidate.errors) == (1, 1)
