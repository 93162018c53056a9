"""Session identity from a request: the header, else the caller and the opening turns of the conversation."""

from __future__ import annotations

import pytest

from gateway.agents.session_ids import (
    MAX_ID_CHARS,
    derived,
    names_session,
    session_id,
    shown_id,
    stored_id,
    stored_ids,
)
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


CODEX_METADATA = '{"session_id": "codex-sess", "turn_id": "t-7"}'


def test_real_agents_name_their_session_in_their_own_headers_in_order() -> None:
    named = [
        ({"x-session-id": "mine", "session-id": "codex", "x-claude-code-session-id": "cc"}, "h:mine"),
        ({"session-id": "codex", "x-codex-turn-metadata": CODEX_METADATA, "x-claude-code-session-id": "cc"},
         "h:codex"),
        ({"x-codex-turn-metadata": CODEX_METADATA, "x-claude-code-session-id": "cc"}, "h:codex-sess"),
        ({"x-claude-code-session-id": "cc"}, "h:cc"),
    ]
    for headers, expected in named:
        assert session_id(headers, STEP_2, "r:resp_1") == expected
        assert names_session(headers)
    assert session_id({"x-session-id": "x" * 1000}, {}) == "h:" + "x" * MAX_ID_CHARS


def test_the_responses_chain_comes_before_the_derived_session() -> None:
    assert session_id({}, CHAT, "r:resp_1") == "r:resp_1"  # even a chain's first call after the root
    assert session_id({}, STEP_2, None) == derived({}, STEP_2) is not None
    assert not names_session({}) and not names_session({"authorization": "Bearer k"})


@pytest.mark.parametrize("metadata", ["", "not json", "[1]", '{"session_id": 5}', '{"session_id": ""}',
                                      "[" * 4000, '{"session_id": "' + "x" * 5000 + '"}'])
def test_codex_metadata_that_names_nothing_falls_through(metadata: str) -> None:
    headers = {"x-codex-turn-metadata": metadata}
    assert session_id(headers, STEP_2) == derived(headers, STEP_2)
    assert not names_session(headers)


@pytest.mark.parametrize("client_id", ["run-1", "h:run-1", "p:abc", "r:resp_1", "outcome-run-4", "a/b c"])
def test_a_session_a_client_names_is_shown_and_found_by_the_clients_own_id(client_id: str) -> None:
    stored = session_id({"x-session-id": client_id}, {})
    assert stored == stored_id(client_id) and shown_id(stored) == client_id
    assert stored in stored_ids(client_id)


def test_a_session_the_gateway_names_goes_by_that_name_and_may_be_ambiguous_with_a_clients() -> None:
    derived_id = session_id({}, STEP_2)
    assert derived_id is not None and shown_id(derived_id) == derived_id
    # a client could send that very id: both sessions are candidates, and finding both is an ambiguity
    assert stored_ids(derived_id) == (stored_id(derived_id), derived_id)
    assert shown_id("r:resp_1") == "r:resp_1" and stored_ids("r:resp_1") == ("h:r:resp_1", "r:resp_1")
    assert stored_ids("run-1") == ("h:run-1",) and stored_ids("h:run-1") == ("h:h:run-1",)
