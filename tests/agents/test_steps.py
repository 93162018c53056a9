"""read_step: where a call stands in its agent loop, from the conversation it carries."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bench import agent_bodies
from gateway.agents.steps import _ASSISTANTS, MAX_MESSAGES, AgentStep, canonical, read_step
from gateway.apis import json_body
from gateway.apis.recurring import Recurring, resume

SYSTEM = {"role": "system", "content": "You are an agent."}
ASK = {"role": "user", "content": "Book me a table for two."}


def _call(name: str, args: dict[str, Any], call_id: str = "c1") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def _result(content: str, call_id: str = "c1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def test_a_new_user_turn_is_step_one_of_planning() -> None:
    assert read_step({"messages": [SYSTEM, ASK]}) == AgentStep(1, "user", False, 0)


def test_a_tool_result_continues_the_loop() -> None:
    messages = [SYSTEM, ASK, _call("search", {"q": "pizza"}), _result('{"places": ["Luigi"]}')]
    assert read_step({"messages": messages}) == AgentStep(2, "tool_result", False, 1)


def test_a_failing_tool_result_is_an_error_only_while_it_is_fed_back() -> None:
    failed = [SYSTEM, ASK, _call("book", {"at": 8}), _result("Exit code: 1\nWall time: 0.1 seconds\nOutput:\nfull")]
    assert read_step({"messages": failed}).tool_error  # type: ignore[union-attr]
    recovered = [*failed, _call("book", {"at": 9}), _result('{"booked": true}')]
    assert not read_step({"messages": recovered}).tool_error  # type: ignore[union-attr]
    json_error = [SYSTEM, ASK, _call("book", {}), _result('{"error": "rate limited"}')]
    assert read_step({"messages": json_error}).tool_error  # type: ignore[union-attr]


def test_a_file_that_mentions_errors_is_no_tool_error_and_a_silent_failure_is_one_when_its_exit_code_says_so() -> None:
    """The traps of reading words: `cat` of an error module (exit 0), a grep that found nothing (exit 1)."""
    read = [SYSTEM, ASK, _call("shell", {"cmd": "cat errors.py"}),
            _result("Exit code: 0\nOutput:\nclass NotFound(Error):\n    \"\"\"failed: denied, invalid\"\"\"")]
    assert not read_step({"messages": read}).tool_error  # type: ignore[union-attr]
    bare = [*read[:-1], _result("class NotFound(Error): 'failed'")]
    assert not read_step({"messages": bare}).tool_error  # type: ignore[union-attr]
    silent = [*read[:-1], _result("Chunk ID: a1\nWall time: 0.01 seconds\nProcess exited with code 1\nOutput:\n")]
    assert read_step({"messages": silent}).tool_error  # type: ignore[union-attr]


def test_the_same_call_in_a_row_counts_however_its_json_is_spelled() -> None:
    looping = [SYSTEM, ASK]
    for spelled in ('{"q": "x", "n": 1}', '{"n":1,"q":"x"}', '{ "q" : "x" , "n" : 1 }'):
        looping += [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "search", "arguments": spelled}}]}, _result("nothing", "c")]
    assert read_step({"messages": looping}).repeated_calls == 3  # type: ignore[union-attr]
    changed = [*looping, _call("search", {"q": "y", "n": 1}), _result("found")]
    assert read_step({"messages": changed}).repeated_calls == 1  # type: ignore[union-attr]


# Arguments as agents send them: JSON text in other spellings, objects (the Anthropic view's input), and values that
# are equal in Python but not in JSON (1, 1.0, True), which must not count as the same call.
_ARGUMENTS = st.sampled_from(['{"q": "x", "n": 1}', '{"n":1,"q":"x"}', '{"q": "x", "n": 1.0}', '{"q": "x", "n": true}',
                              '{"q": "y"}', "not json", " not json ", {"q": "x", "n": 1}, {"n": True, "q": "x"}, None])


@given(st.lists(st.tuples(st.sampled_from(["search", "open"]), _ARGUMENTS), max_size=12))
def test_the_run_of_repeated_calls_is_the_run_of_equal_canonical_calls(calls: list[tuple[str, Any]]) -> None:
    """The run walked back lazily equals the run over every call made canonical (its definition)."""
    messages: list[dict[str, Any]] = [ASK]
    for i, (name, arguments) in enumerate(calls):
        messages += [{"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function",
                                                          "function": {"name": name, "arguments": arguments}}]},
                     _result("ok", f"c{i}")]
    every = [(name, canonical(arguments)) for name, arguments in calls]
    expected = next((i for i, call in enumerate(reversed(every)) if call != every[-1]), len(every)) if every else 0
    assert read_step({"messages": messages}).repeated_calls == expected  # type: ignore[union-attr]


@given(st.lists(st.one_of(st.none(), st.integers(), st.text(), st.dictionaries(st.text(), st.text())), max_size=5))
def test_odd_messages_never_raise(messages: list[Any]) -> None:
    found = read_step({"messages": messages})
    assert found is None or found.step >= 1


DEEP_ARGS = '{"a":' * 5000 + "1" + "}" * 5000  # valid JSON text, too deep for Python's parser


def test_malformed_tool_calls_are_ignored_and_deep_arguments_compared_as_written() -> None:
    for calls in (5, "search", [5, None, "x"], [{"function": "search"}], {"function": {"name": "f"}}):
        messages = [ASK, {"role": "assistant", "tool_calls": calls}, _result("fine")]
        assert read_step({"messages": messages}) == AgentStep(2, "tool_result", False, 0)
    deep = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP_ARGS}}]}
    messages = [ASK, deep, _result("fine"), deep, _result("fine")]
    assert read_step({"messages": messages}) == AgentStep(3, "tool_result", False, 2)
    assert canonical(DEEP_ARGS) == DEEP_ARGS and canonical(' {"b": 1, "a": 2} ') == '{"a":2,"b":1}'


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=12)


@given(st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "function", "name"]),
                                st.sampled_from(["assistant", "tool", "user"]) | JSON, max_size=4), max_size=5))
def test_any_json_shape_of_messages_never_raises(messages: list[Any]) -> None:
    found = read_step({"messages": messages})
    assert found is None or found.step >= 1


def test_an_anthropic_tool_result_that_says_is_error_is_a_tool_error() -> None:
    from gateway.agents.trajectory import tool_results
    from gateway.apis.messages import wire as messages

    body = {"model": "auto", "max_tokens": 8, "messages": [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "done", "is_error": True}]},
    ]}
    view = messages.view(body)
    step = read_step(view)
    assert step is not None and step.turn == "tool_result" and step.tool_error
    assert [r.ok for r in tool_results(view["messages"], keep=False)] == [False]


def test_an_anthropic_tool_result_that_says_it_is_no_error_is_none_whatever_its_words() -> None:
    """Claude Code sends `is_error: false` on every result: a command that printed an error-shaped line and
    exited 0 is no tool error (the flag outranks word shapes, not a harness's exit code)."""
    from gateway.agents.trajectory import tool_results
    from gateway.apis.messages import wire as messages

    said = "error: the word, printed by a command that succeeds"
    body = {"model": "auto", "max_tokens": 8, "messages": [
        {"role": "user", "content": "print it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": said, "is_error": False}]},
    ]}
    view = messages.view(body)
    step = read_step(view)
    assert step is not None and step.turn == "tool_result" and not step.tool_error
    assert [r.ok for r in tool_results(view["messages"], keep=False)] == [True]
    del body["messages"][2]["content"][0]["is_error"]  # no flag: the words' shape decides
    assert read_step(messages.view(body)).tool_error  # type: ignore[union-attr]


def test_a_continued_step_counts_its_assistant_turns_on_from_the_step_before() -> None:
    memory = Recurring(8 << 20)
    long_run = [SYSTEM, ASK, *[m for i in range(110) for m in (_call("ls", {"i": i}, f"c{i}"), _result("ok", f"c{i}"))]]
    sessions = [agent_bodies.session(4, 60 * 1024, 3_000, steps=4),
                [{"messages": long_run[:n], "pad": "p" * 20_000} for n in (180, 200, 202, 222)]]  # past MAX_MESSAGES
    for steps in sessions:
        for i, step in enumerate(steps):
            sent = json_body.read(json.dumps(step).encode(), "messages", memory)
            went_on = resume(sent.conversation, sent.body["messages"], _ASSISTANTS)[0] is not None
            assert read_step(sent.body, sent.conversation) == read_step(json.loads(json.dumps(step)))
            assert went_on == (i > 0) or len(step["messages"]) > MAX_MESSAGES  # past it: the recent ones counted
