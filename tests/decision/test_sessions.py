"""Session identity from a request: header, then `user`, then a hash of the opening messages."""

from __future__ import annotations

from gateway.decision.sessions import session_id
from gateway.policy.tenancy import SessionPolicy
from gateway.store.memory import MemoryStore

CHAT = {
    "messages": [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Fix the bug"}]
}


def test_header_wins_then_user_then_opening_messages() -> None:
    assert session_id({"x-session-id": "run-42"}, {**CHAT, "user": "u1"}) == "h:run-42"
    assert session_id({}, {**CHAT, "user": "u1"}) == "u:u1"
    derived = session_id({}, CHAT)
    assert derived is not None and derived.startswith("p:")


def test_later_turns_keep_the_derived_session() -> None:
    later = {
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go"},
        ]
    }
    assert session_id({}, later) == session_id({}, CHAT)
    other = {
        "messages": [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Other"}]
    }
    assert session_id({}, other) != session_id({}, CHAT)


def test_odd_shapes_never_raise() -> None:
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug"}, {"type": "image_url"}]}
        ]
    }
    assert session_id({}, parts) is not None
    assert session_id({}, {"messages": [{"role": "user", "content": None}]}) is not None
    assert session_id({}, {"prompt": "hi"}) is None
    assert session_id({}, {"messages": "nonsense"}) is None
    assert session_id({}, {"messages": [{"role": "system", "content": "x"}]}) is None
    assert len(session_id({"x-session-id": "a" * 10_000}, {}) or "") <= 258


async def test_step_counts_through_the_store() -> None:
    store = MemoryStore()
    policy = SessionPolicy(rate_window_s=60)
    await store.step("acme", "h:1", policy.rate_window_s, policy.idle_ttl_s)
    state = await store.step("acme", "h:1", policy.rate_window_s, policy.idle_ttl_s)
    assert (state.session_id, state.steps, state.steps_per_min) == ("h:1", 2, 2.0)
