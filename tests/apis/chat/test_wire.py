"""openai.check: the fields the gateway reads are checked, each named in its 400; every other field passes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.apis.chat.wire import check
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
