"""A step's digest from the request and the response: tool calls (whole and streamed), tool results, echoes."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.agents.steps import read_step
from gateway.agents.tool_outcomes import judge
from gateway.agents.trajectory import (
    MAX_TOOL_CALLS,
    MAX_TOOL_RESULTS,
    Step,
    ToolCall,
    ToolResult,
    args_digest,
    echo,
    last_prompt,
    steps_per_min,
    tool_calls_in_body,
    tool_calls_in_stream,
    tool_results,
)


def _call(name: str, arguments: str, call_id: str = "c1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _body(*calls: dict[str, Any], content: str | None = None) -> bytes:
    message = {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls else {})}
    return json.dumps({"choices": [{"index": 0, "message": message}], "usage": {"prompt_tokens": 1}}).encode()


def test_arguments_are_the_same_call_whatever_their_spacing_or_key_order() -> None:
    same = args_digest('{"a": 1, "b": [2, 3]}')
    assert same == args_digest('{"b":[2,3],"a":1}') == args_digest({"b": [2, 3], "a": 1})
    assert args_digest('{"a": 1}') != args_digest('{"a": 2}')
    assert args_digest("not json ") == args_digest("not json") and len(args_digest("x")) == 16


def test_tool_calls_of_a_whole_response_every_one_kept_as_a_digest() -> None:
    raw = _body(_call("search", '{"q": "x"}', "c1"), _call("open", '{"id": 3}', "c2"))
    calls = tool_calls_in_body(raw)
    assert [(c.name, c.call_id) for c in calls] == [("search", "c1"), ("open", "c2")]
    assert calls[0].args_digest == args_digest('{"q":"x"}') and calls[0].arguments is None
    assert tool_calls_in_body(raw, keep=True)[1].arguments == '{"id": 3}'


@pytest.mark.parametrize("raw", [_body(content="plain answer"), b"{not json", b'{"tool_calls": 3}',
                                 json.dumps({"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}).encode()])
def test_a_response_without_usable_tool_calls_has_none(raw: bytes) -> None:
    assert tool_calls_in_body(raw) == ()


def _events(*deltas: dict[str, Any]) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [d]}}]} for d in deltas]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (text + "data: [DONE]\n\n").encode()


STREAM = _events({"index": 0, "id": "c1", "function": {"name": "search", "arguments": ""}},
                 {"index": 0, "function": {"arguments": '{"q": '}},
                 {"index": 1, "id": "c2", "function": {"name": "open", "arguments": '{"id": 3}'}},
                 {"index": 0, "function": {"arguments": '"x"}'}})


def test_streamed_tool_calls_are_accumulated_by_index() -> None:
    calls = tool_calls_in_stream([STREAM])
    assert [(c.name, c.call_id, c.args_digest) for c in calls] == [
        ("search", "c1", args_digest('{"q":"x"}')), ("open", "c2", args_digest('{"id":3}'))]


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=6))
def test_stream_chunk_boundaries_do_not_change_the_calls(cuts: list[int]) -> None:
    edges = [0, *sorted(set(cuts)), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(edges)]
    assert tool_calls_in_stream(chunks) == tool_calls_in_stream([STREAM])


def test_a_stream_kept_from_mid_event_skips_the_broken_event() -> None:
    calls = tool_calls_in_stream([STREAM[10:]])
    assert [c.name for c in calls] == ["open"]  # the first event, cut, named `search`


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "find it"},
    {"role": "assistant", "content": None, "tool_calls": [_call("search", "{}", "c0")]},
    {"role": "tool", "tool_call_id": "c0", "content": "Error: timeout"},
    {"role": "assistant", "content": "Let me retry.", "tool_calls": [_call("search", "{}", "c1"),
                                                                    _call("open", "{}", "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "2 hits"}]},
    {"role": "tool", "tool_call_id": "c2", "content": '{"error": "not allowed"}'},
]


def test_tool_results_are_the_outputs_after_the_last_assistant_message() -> None:
    found = tool_results(MESSAGES)
    assert [(r.tool_call_id, r.ok, r.size) for r in found] == [("c1", True, 6), ("c2", False, 24)]
    assert found[0].content is None and tool_results(MESSAGES, keep=True)[0].content == "2 hits"
    assert tool_results(MESSAGES[:3]) == () and tool_results("odd") == ()


@pytest.mark.parametrize(("output", "ok", "source", "exit_code"), [
    ("Exit code: 2\nWall time: 0.1 seconds\nOutput:\nls: x", False, "exit_code", 2),
    ("<returncode>0</returncode>\n<output>\nclass Error: 'failed, not found, denied'\n</output>", True, "exit_code", 0),
    ('Traceback (most recent call last):\n  File "a.py", line 1, in <module>\nKeyError: 1', False, "traceback", None),
    ('{"status": "ok", "error": "none left"}', False, "json_error", None),
    ("Error: timeout", False, "error_line", None), ("3 hits", True, "none", None),
    ("0 errors found", True, "none", None), ("", True, "none", None)])
def test_each_tool_result_records_its_verdict_and_what_said_so(output: str, ok: bool, source: str,
                                                                exit_code: int | None) -> None:
    (result,) = tool_results([{"role": "tool", "tool_call_id": "c", "content": output}])
    assert (result.ok, result.source, result.exit_code) == (ok, source, exit_code)


def test_the_echo_is_the_last_assistant_message_text_whitespace_folded() -> None:
    assert echo(MESSAGES) == echo([{"role": "assistant", "content": " Let me\n retry. "}]) != ""
    assert echo(MESSAGES[:3]) == ""  # a tool call without text says nothing
    assert echo([{"role": "user", "content": "hi"}]) == ""
    assert last_prompt(MESSAGES) == "find it"


def test_a_step_round_trips_and_shows_only_the_contract() -> None:
    step = Step(1.5, "hq", "r", "candidate", 3, 4, 0.01, 2.0, None, 200, (ToolCall("s", "d" * 16, "c1"),),
                (ToolResult("c0", False, 5, "e" * 16),), echo="f" * 16, rework=True, flags=("loop:x",), step=7)
    assert Step.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    shown = step.shown()
    assert shown["tool_calls"] == [{"name": "s", "args_digest": "d" * 16}]
    assert shown["tool_results"] == [{"tool_call_id": "c0", "ok": False, "size": 5}]
    assert "echo" not in shown and "rework" not in shown and shown["step"] == 7


def test_a_tool_results_verdict_round_trips_and_is_shown_and_an_older_record_reads_without_one() -> None:
    judged = ToolResult("c0", False, 5, "e" * 16, None, "exit_code", 2)
    step = Step(1.5, "hq", "r", None, 3, 4, 0.01, 2.0, None, 200, (), (judged,), step=1)
    assert Step.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    assert step.shown()["tool_results"] == [
        {"tool_call_id": "c0", "ok": False, "size": 5, "source": "exit_code", "exit_code": 2}]
    older = ToolResult.from_dict({"tool_call_id": "c0", "ok": True, "size": 5, "d": "e" * 16})
    assert (older.source, older.exit_code) == ("", None)


def test_steps_per_min_counts_the_trailing_minute() -> None:
    earlier = [Step(at, "hq", "r", None, 0, 0, 0.0, 0.0, None, 200) for at in (0.0, 30.0, 61.0, 90.0)]
    assert steps_per_min(earlier, 100.0) == 3.0  # 61, 90 and the step at 100: (40, 100]


@pytest.mark.parametrize(("body", "headers", "recorded"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, {}, False),
    ({"messages": [{"role": "user", "content": "hi"}]}, {"x-session-id": "run-1"}, True),
    ({"messages": [{"role": "user", "content": "hi"}], "user": "alice"}, {}, False),  # `user` names no session
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     {}, True),
    ({"messages": MESSAGES}, {}, True),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}]}, {}, True),
])
def test_what_is_an_agent_step(body: dict[str, Any], headers: dict[str, str], recorded: bool) -> None:
    from gateway.agents.trajectory import is_step
    from gateway.features import extract

    assert is_step(extract({"model": "auto", **body}, "chat"), headers) is recorded


DEEP_ARGS = '{"a":' * 5000 + "1" + "}" * 5000  # valid JSON text, too deep for Python's parser


def test_deep_or_malformed_tool_calls_are_read_without_raising() -> None:
    assert args_digest(DEEP_ARGS) == args_digest(DEEP_ARGS + " ") and len(args_digest(DEEP_ARGS)) == 16
    (call,) = tool_calls_in_body(_body(_call("search", DEEP_ARGS)), keep=True)
    assert call.name == "search" and call.arguments == DEEP_ARGS[:4096]
    odd = json.dumps({"choices": [{"message": {"tool_calls": [5, None, _call("open", "{}")]}}]}).encode()
    assert [c.name for c in tool_calls_in_body(odd)] == ["open"]
    assert tool_calls_in_body(b'{"tool_calls": ' + b"[" * 5000 + b"]" * 5000 + b"}") == ()


def test_a_step_reads_a_bounded_number_and_size_of_what_it_is_sent() -> None:
    flood = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [_call("f", "{}")]},
             *({"role": "tool", "tool_call_id": f"t{i}", "content": "z" * 10} for i in range(10_000))]
    found = tool_results(flood)
    assert len(found) == MAX_TOOL_RESULTS and found[-1].tool_call_id == "t9999"
    huge = "Exit code: 1\nOutput:\n" + "y" * 1_000_000
    (result,) = tool_results([{"role": "tool", "tool_call_id": "t", "content": huge}], keep=True)
    assert (result.ok, result.size, result.content) == (False, len(huge), huge[:4096])
    assert result.digest != tool_results([{"role": "tool", "content": huge + "y"}])[0].digest  # its size counts
    many = json.dumps({"choices": [{"message": {"tool_calls": [_call("f", "{}", str(i)) for i in range(500)]}}]})
    assert len(tool_calls_in_body(many.encode())) == MAX_TOOL_CALLS
    deltas = [{"index": i, "id": str(i), "function": {"name": "f", "arguments": "{}"}} for i in range(500)]
    event = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": deltas}}]})
    assert len(tool_calls_in_stream([f"data: {event}\n\n".encode()])) == MAX_TOOL_CALLS


# Tool outputs as agents send them back: ok and failing by exit code, a traceback, an `is_error` flag, content
# parts (judged on their joined text, which routing and the record join apart), and messages routing stops at.
_OUTPUTS = st.sampled_from([
    "Exit code: 0\nOutput:\nok", "Exit code: 1\nOutput:\nFAILED tests/test_x.py::t", '{"error": "denied"}',
    "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad", "plain text",
    [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "Error: no"}], None])
_TRAILING = st.lists(st.one_of(
    st.builds(lambda content, flag: {"role": "tool", "tool_call_id": "c", "content": content,
                                     **({"is_error": True} if flag else {})}, _OUTPUTS, st.booleans()),
    st.just({"role": "user", "content": "go on"})), max_size=8)


@given(_TRAILING)
def test_the_record_takes_routings_verdicts_and_they_are_what_judging_each_result_gives(
    trailing: list[dict[str, Any]],
) -> None:
    """Each tool result is judged once a request (routing's verdicts reused by the record), with the same outcome as
    when the record judged them all itself."""
    messages = [{"role": "user", "content": "fix it"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "shell", "arguments": "{}"}}]}, *trailing]
    step = read_step({"messages": messages})
    assert step is not None
    assert tool_results(messages, judged=step.verdicts) == tool_results(messages)


def test_routings_verdict_is_taken_for_the_text_it_judged_and_parts_are_judged_again() -> None:
    """The record takes routing's verdict of a plain-text result as it is (no second judging: a verdict unlike the
    text's shows it was taken); a result of content parts, whose text routing joins otherwise, is judged anew."""
    ok = judge("Exit code: 0")
    text = [{"role": "tool", "tool_call_id": "c", "content": "Exit code: 1"}]
    assert tool_results(text, judged=(ok,))[0].ok
    parts = [{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "Exit code: 1"}]}]
    assert not tool_results(parts, judged=(ok,))[0].ok
