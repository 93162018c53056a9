"""Session identity from a request: the header, else the caller and the opening turns of the conversation."""

from __future__ import annotations

from gateway.decision.sessions import session_id
from gateway.policy.tenancy import SessionPolicy
from gateway.store.memory import MemoryStore

CHAT = {
    "messages": [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Fix the bug"}]
}


REPLY = {"role": "assistant", "content": "Looking at the stack trace."}
STEP_2 = {"messages": [*CHAT["messages"], REPLY, {"role": "user", "content": "go on"}]}


def test_the_header_names_the_session_else_the_caller_and_the_opening_turns() -> None:
    assert session_id({"x-session-id": "run-42"}, {**STEP_2, "user": "u1"}) == "h:run-42"
    derived = session_id({}, STEP_2)
    assert derived is not None and derived.startswith("p:")
    # a first step is every conversation that opens this way: no session to count, pin or cap
    assert session_id({}, CHAT) is None and session_id({}, {**CHAT, "user": "u1"}) is None


def test_later_steps_keep_the_derived_session_and_other_conversations_get_their_own() -> None:
    step_3 = {"messages": [*STEP_2["messages"], {"role": "assistant", "content": "done"},
                           {"role": "user", "content": "thanks"}]}
    assert session_id({}, step_3) == session_id({}, STEP_2)
    other_reply = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Which file?"},
                                {"role": "user", "content": "go on"}]}
    tool_reply = {"messages": [*CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "bug"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x.py:3"}]}
    derived = {
        session_id({}, STEP_2),
        session_id({}, other_reply),
        session_id({}, tool_reply),
        session_id({"authorization": "Bearer key-a"}, STEP_2),
        session_id({"authorization": "Bearer key-b"}, STEP_2),
        session_id({}, {**STEP_2, "user": "u1"}),
    }
    assert len(derived) == 6 and None not in derived


def test_odd_shapes_never_raise() -> None:
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"function": "not an object"}, 7]},
        ]
    }
    assert session_id({}, parts) is not None
    assert session_id({}, {"messages": [{"role": "user", "content": None}, {"role": "assistant"}]}) is not None
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
