"""openai.check: the fields the gateway reads are checked, each named in its 400; every other field passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import agent_bodies
from gateway.apis.chat import wire as chat_wire
from gateway.apis.chat.adapter import OpenAIAdapter
from gateway.apis.chat.wire import check
from gateway.apis.recurring import Recurring
from gateway.errors import BadRequest

CHAT: dict[str, Any] = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("stream", "yes", "expected a boolean, got a string"),
    ("stream_options", [], "expected an object, got an array"),
    ("tools", {}, "expected an array, got an object"),
    ("max_tokens", "ten", "expected an integer, got a string"),
    ("max_completion_tokens", 1.5, "expected an integer, got a number"),
    ("n", True, "expected an integer, got a boolean"),  # a JSON true is never a count
    ("temperature", "hot", "expected an integer or a number, got a string"),
    ("max_tokens", 0, "'max_tokens' must be at least 1, got 0"),
    ("n", -2, "'n' must be at least 1, got -2"),
])
def test_a_read_field_of_the_wrong_type_or_count_is_a_400_naming_it(field: str, value: Any, needle: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check({**CHAT, field: value}, "chat")
    assert needle in str(refused.value) and refused.value.param == field


def test_absent_null_and_unknown_fields_pass() -> None:
    check(CHAT, "chat")
    check({**CHAT, "stream": None, "max_tokens": None, "temperature": None, "tools": None}, "chat")
    check({**CHAT, "temperature": 0, "n": 1, "max_completion_tokens": 5, "stream": True, "top_k": "any"}, "chat")


def test_the_first_bad_field_in_order_is_the_one_named() -> None:
    with pytest.raises(BadRequest) as refused:
        check({**CHAT, "temperature": "hot", "stream": "yes", "n": 0}, "chat")
    assert refused.value.param == "stream"


def test_a_continued_step_checks_the_messages_it_adds_and_names_a_bad_one_where_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    memory, adapter = Recurring(8 << 20), OpenAIAdapter("chat")
    steps = agent_bodies.session(3, 40 * 1024, 2_000, steps=2)
    starts: list[int] = []
    resumed = chat_wire.resume
    monkeypatch.setattr(chat_wire, "resume", lambda *args: starts.append(resumed(*args)[1]) or resumed(*args))
    for step in steps:
        adapter.parse(json.dumps(step).encode(), memory)
    assert starts == [0, len(steps[0]["messages"])]  # the second step checked only the call and result it adds
    at = len(steps[1]["messages"])
    bad = {**steps[1], "messages": [*steps[1]["messages"], {"role": 7}]}
    with pytest.raises(BadRequest, match=rf"'messages\[{at}\]' must be an object with a string 'role'"):
        adapter.parse(json.dumps(bad).encode(), memory)
    assert starts[-1] == at
    first = {**steps[0], "messages": [steps[0]["messages"][0], "no message", *steps[0]["messages"][1:]]}
    with pytest.raises(BadRequest, match=r"'messages\[1\]' must be an object"):
        adapter.parse(json.dumps(first).encode(), Recurring(8 << 20))
