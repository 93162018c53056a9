"""Properties of sticky, monotone bucketing and of session stickiness."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gateway.rollout.assignment import sticky_key
from gateway.rollout.step import (
    Arm,
    Assignment,
    Phase,
    RolloutState,
    assign,
    assign_session,
    bucket,
    shadow_sampled,
)

keys = st.text(min_size=1, max_size=40)
salts = st.text(min_size=1, max_size=20)
weights = st.floats(min_value=0, max_value=100, allow_nan=False)


def at(weight: float, salt: str = "r1", phase: Phase = Phase.PROGRESSING) -> RolloutState:
    return RolloutState(salt, phase, weight_pct=weight)


@given(salts, keys)
def test_bucket_is_in_unit_interval_and_deterministic(salt: str, key: str) -> None:
    assert 0.0 <= bucket(salt, key) < 1.0
    assert bucket(salt, key) == bucket(salt, key)


@given(salts, keys, weights, weights)
def test_raising_the_weight_only_moves_keys_towards_the_candidate(
    salt: str, key: str, w1: float, w2: float
) -> None:
    low, high = sorted((w1, w2))
    before, after = assign(at(low, salt), key), assign(at(high, salt), key)
    if before is Arm.CANDIDATE:
        assert after is Arm.CANDIDATE
    if after is Arm.STABLE:
        assert before is Arm.STABLE  # the untouched stable range only shrinks


@given(salts, keys, weights)
def test_abort_sends_everyone_to_stable(salt: str, key: str, weight: float) -> None:
    assert assign(at(weight, salt, Phase.ABORTED), key) is Arm.STABLE
    assert assign(None, key) is Arm.STABLE  # no readable state: fail safe


def test_shares_match_the_weight_and_control_mirrors_the_candidate() -> None:
    arms = [assign(at(10), f"user=u{i}") for i in range(20_000)]
    assert abs(arms.count(Arm.CANDIDATE) / 20_000 - 0.10) < 0.01
    assert abs(arms.count(Arm.CONTROL) / 20_000 - 0.10) < 0.01
    assert assign(at(100), None) is Arm.CANDIDATE and assign(at(50), None) is Arm.STABLE


def test_a_new_salt_reshuffles_and_the_same_salt_keeps_assignments() -> None:
    users = [f"user=u{i}" for i in range(4000)]
    first = {u for u in users if assign(at(50, "rollout-a"), u) is Arm.CANDIDATE}
    same = {u for u in users if assign(at(50, "rollout-a"), u) is Arm.CANDIDATE}
    other = {u for u in users if assign(at(50, "rollout-b"), u) is Arm.CANDIDATE}
    assert first == same
    overlap = len(first & other) / len(first)
    assert 0.45 < overlap < 0.55  # independent: about half of A's candidates are B's


@given(keys, st.lists(weights, min_size=1, max_size=6))
def test_a_session_keeps_its_first_arm_until_abort(key: str, later: list[float]) -> None:
    state = at(10)
    recorded = assign_session(state, key, None)
    assert recorded is not None and recorded.arm is assign(state, key)
    for weight in sorted(later):
        state = replace(state, weight_pct=max(10.0, weight))
        assert assign_session(state, key, recorded) == recorded
    aborted = assign_session(replace(state, phase=Phase.ABORTED), key, recorded)
    assert aborted is not None and aborted.arm is Arm.STABLE
    retried = replace(state, weight_pct=0.0, run=state.run + 1)
    fresh = assign_session(retried, key, recorded)
    assert (
        fresh is not None and fresh.arm is Arm.STABLE and fresh.run == 1
    )  # the aborted run's record is void


def test_assignment_encoding_round_trips_and_tolerates_garbage() -> None:
    a = Assignment("hq-v2|odd", 3, Arm.CONTROL)
    assert Assignment.decode(a.encode()) == a
    assert Assignment.decode("nonsense") is None and Assignment.decode("x|martian|r") is None
    assert assign_session(None, "k", a) is None


def test_sticky_key_takes_the_first_present_source() -> None:
    chain = ("header:x-session-id", "user", "api_key")
    assert sticky_key(chain, headers={"x-session-id": "s1"}, user="u") == "header:x-session-id=s1"
    assert sticky_key(chain, headers={}, user="u", api_key="k") == "user=u"
    assert sticky_key(chain, headers={}, api_key="k") == "api_key=k"
    assert sticky_key(chain, headers={}) is None


def test_shadow_sampling_spares_the_candidate_arm_and_stops_on_abort() -> None:
    state = replace(at(10), shadow_pct=30)
    users = [f"user=u{i}" for i in range(10_000)]
    share = sum(shadow_sampled(state, Arm.STABLE, u) for u in users) / len(users)
    assert abs(share - 0.30) < 0.02
    assert not any(shadow_sampled(state, Arm.CANDIDATE, u) for u in users[:100])
    assert not any(shadow_sampled(replace(state, phase=Phase.ABORTED), Arm.STABLE, u) for u in users[:100])
