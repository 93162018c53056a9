"""The C chat walk (gateway/native/_features_walk.c) against features.py's Python walk, its fallbacks and its guards."""

from __future__ import annotations

import csv
import gzip
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loadgen import payloads
from gateway import features
from gateway.features import CODE_MARKERS, EXACT_CHARS_PER_MESSAGE, EXACT_CHARS_TOTAL, MATH_MARKERS, Features
from tests.classifier.test_cues import CMMLU, FEW_SHOT, GSM8K, HUMANEVAL, LATEX, MBPP, MMLU
from tests.fixtures.classifier_data import synthetic_rows

try:
    from gateway.native import _features_walk
except ImportError:  # not built (see pytestmark)
    _features_walk = None  # type: ignore[assignment]

# Where the extension did not compile outside CI, these tests skip and the Python walk serves; in CI they all run,
# and the build check fails.
pytestmark = pytest.mark.skipif(features.native is None and os.environ.get("CI") != "true",
                                reason="the optional C extension did not build")

# the labelled sets beside the repository (../shared/data/routing, as the README says)
ROUTING = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing"
FILLER = ("lorem ipsum dolor sit amet " * 400)[:EXACT_CHARS_PER_MESSAGE]
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "critic")


@contextmanager
def python_walk() -> Iterator[None]:
    """Every extract() inside reads its request with the Python walk (usable inside a hypothesis test)."""
    walker, features.native = features.native, None
    try:
        yield
    finally:
        features.native = walker


class Recording:
    """A walker that delegates to the real one and remembers whether it walked (True) or declined (False)."""

    def __init__(self, walker: Any) -> None:
        self.walker = walker
        self.walked: list[bool] = []

    def walk(self, *args: Any) -> Any:
        result = self.walker.walk(*args)
        self.walked.append(result is not None)
        return result

    def markers(self, window: str) -> Any:
        return self.walker.markers(window)


def both(body: dict[str, Any]) -> tuple[Features, Features, bool]:
    """extract() through the C walk and through the Python walk, and whether the C walk read the messages."""
    recording = Recording(features.native)
    features.native = recording  # type: ignore[assignment]
    try:
        native = features.extract(body, "chat")
    finally:
        features.native = recording.walker
    with python_walk():
        python = features.extract(body, "chat")
    return native, python, recording.walked == [True]


def chat(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def shapes(prompt: str) -> Iterator[dict[str, Any]]:
    """One prompt as the chats clients send: the str-content shapes the C walk reads."""
    yield chat({"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt})
    yield chat({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4, since 2 + 2 == 4."},
               {"role": "user", "content": prompt}, {"role": "assistant", "content": prompt[::-1]},
               {"role": "user", "content": "And now?"})
    yield chat({"role": "developer", "content": prompt[:200]}, {"role": "user", "content": prompt})
    yield chat({"role": "user", "content": ""}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": prompt[:80]}}]},
        {"role": "tool", "content": prompt}, {"content": prompt[:50]}, {"role": "user", "content": prompt})
    # over both budgets: memoized filler spends all but 3,000 of the request's exact characters, then a message
    # over the per-message cap, then the prompt, exact or estimated by its length
    long = prompt * (EXACT_CHARS_PER_MESSAGE // max(len(prompt), 1) + 1)
    yield chat({"role": "system", "content": FILLER}, *({"role": "user", "content": FILLER[:7_000]} for _ in range(3)),
               {"role": "assistant", "content": long}, {"role": "user", "content": prompt})
    yield chat({"role": "user", "content": prompt + " — ∑ café 日本語 \U0001f389 \ud800 İ \u212a"})


def routing_prompts(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as rows:
        return [row["prompt"] for row in csv.DictReader(rows)]


def repository_prompts() -> list[str]:
    """The repository's own prompts: read wherever the labelled sets beside it are not (a clean clone in CI)."""
    bench = [json.loads(body)["messages"][0]["content"] for body in payloads(False)[:2_000]]
    return [*bench, *(row["prompt"] for row in synthetic_rows(1_000)), CMMLU, FEW_SHOT, GSM8K, HUMANEVAL, LATEX,
            MBPP, MMLU]


@pytest.mark.parametrize("path", [None, *sorted(ROUTING.glob("*.csv.gz"))],
                         ids=lambda path: "repository" if path is None else path.name)
def test_every_labelled_prompt_in_every_shape_reads_the_same(path: Path | None) -> None:
    prompts = repository_prompts() if path is None else routing_prompts(path)
    assert prompts
    for prompt in prompts:
        for body in shapes(prompt):
            native, python, walked = both(body)
            assert walked, body
            assert native == python, body


def test_the_extension_is_built_and_walks_a_simple_chat() -> None:
    assert features.native is not None, "gateway/native/_features_walk.c did not build: setup.py build_ext --inplace"
    native, python, walked = both(chat({"role": "user", "content": "def f(x): return x == 2"}))
    assert walked and native == python and native.has_code


DECLINED = [
    pytest.param(chat({"role": "user", "content": [{"type": "text", "text": "hello"}]}), id="content parts"),
    pytest.param(chat(OrderedDict(role="user", content="hello")), id="a dict subclass message"),
    pytest.param(chat({"role": "user", "content": type("Text", (str,), {})("hello")}), id="a str subclass content"),
    pytest.param(chat({"role": type("Role", (str,), {})("user"), "content": "hi"}), id="a str subclass role"),
    pytest.param(chat({"role": "assistant", "content": "x", "tool_calls": [OrderedDict(function={"name": "f"})]}),
                 id="a dict subclass tool call"),
    pytest.param(chat({"role": "user", "content": "x"}, {"role": "assistant", "function_call": OrderedDict(name="f")}),
                 id="a dict subclass legacy function call"),
]


@pytest.mark.parametrize("body", DECLINED)
def test_other_shapes_fall_back_to_the_python_walk(body: dict[str, Any]) -> None:
    native, python, walked = both(body)
    assert not walked
    assert native == python


def test_non_list_messages_and_other_endpoints_take_the_python_walk() -> None:
    for body in ({"messages": ({"role": "user", "content": "hi"},)}, {"messages": None}, {}):
        native, python, walked = both(body)
        assert not walked and native == python
    with python_walk():
        assert features.extract({"prompt": "hi"}, "completions") == features.extract({"prompt": "hi"}, "completions")


@st.composite
def contents(draw: st.DrawFn) -> Any:
    text = st.text(max_size=30) | st.lists(st.sampled_from(CODE_MARKERS + MATH_MARKERS + ("self", "a", " ")))
    text = text.map(lambda value: value if isinstance(value, str) else "".join(value))
    typed_part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
    part: st.SearchStrategy[Any] = text | typed_part | st.builds(dict, refusal=text)
    return draw(text | st.none() | st.lists(part | st.integers(), max_size=3) | st.builds(dict, text=text)
                | st.integers() | st.booleans())


@st.composite
def messages(draw: st.DrawFn) -> Any:
    message: dict[str, Any] = {}
    if draw(st.booleans()):
        message["role"] = draw(st.sampled_from(ROLES) | st.none() | st.integers())
    if draw(st.integers(0, 4)):
        message["content"] = draw(contents())
    function = st.fixed_dictionaries({}, optional={"name": st.text(max_size=8) | st.integers(),
                                                   "arguments": st.text(max_size=20) | st.none()})
    if draw(st.booleans()):
        call = st.fixed_dictionaries({}, optional={"function": function | st.integers()}) | st.none()
        message["tool_calls"] = draw(st.lists(call, max_size=3) | st.none() | st.integers())
    if draw(st.integers(0, 4)) == 0:
        message["function_call"] = draw(function | st.none() | st.just(""))
    not_a_message = st.sampled_from([None, "user", 7, ["role", "user"]])
    return draw(not_a_message) if draw(st.integers(0, 9)) == 0 else message


@settings(max_examples=200, deadline=None)
@given(st.lists(messages(), max_size=8))
def test_any_message_list_reads_the_same_as_the_python_walk(listed: list[Any]) -> None:
    native, python, _ = both({"model": "m", "messages": listed})
    assert native == python


MARKER_PIECES = CODE_MARKERS + MATH_MARKERS + ("my", "re", "dys", "self", "print", "İ", "\u212a", "∑", "日", "X", " ")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.sampled_from(MARKER_PIECES), max_size=12).map("".join), min_size=1, max_size=4))
def test_markers_read_the_same_as_the_python_tests(texts: list[str]) -> None:
    """Overlapping markers (a rejected "self." hiding a later one, as finditer resumes after a match), folded case
    and characters whose lower case is ASCII."""
    native, python, walked = both(chat(*({"role": "user", "content": text} for text in texts)))
    assert walked and native == python
    window = features.scan_window(texts)  # the tests alone, on a window a continued step builds
    assert features.native is not None
    assert features.native.markers(window) == (features.has_code(window), features.has_math(window))


def test_the_marker_tests_alone_take_a_str_only() -> None:
    assert features.native is not None
    with pytest.raises(TypeError, match="markers\\(\\) takes a str, got bytes"):
        features.native.markers(b"self.x")  # type: ignore[arg-type]


def test_the_prose_word_rule_hides_an_overlapping_marker_as_the_regex_does() -> None:
    """finditer resumes after "print(" in "reprint();", so the "();" inside it never counts."""
    for text in ("reprint();", "myself.x", "dysfunction();", "print();", "x.self.y"):
        native, python, walked = both(chat({"role": "user", "content": text}))
        assert walked and native == python, text
    assert not both(chat({"role": "user", "content": "reprint();"}))[0].has_code


def test_counts_stop_being_exact_where_the_budgets_say() -> None:
    short, edge = "word " * 10, "x" * EXACT_CHARS_PER_MESSAGE
    for body in (chat({"role": "user", "content": edge}), chat({"role": "user", "content": edge + "x"}),
                 chat(*({"role": "user", "content": edge} for _ in range(EXACT_CHARS_TOTAL // len(edge) + 1)),
                      {"role": "user", "content": short})):
        native, python, walked = both(body)
        assert walked and native == python


def test_without_an_encoding_every_count_is_an_estimate() -> None:
    walker = features.native
    assert walker is not None
    walked = walker.walk([{"role": "user", "content": "hello"}], 100, None, features.estimate_tokens)
    assert walked is not None and walked[0][2] == features.estimate_tokens("hello") and walked[1:] == (100, False)


def test_a_failing_count_raises_through_the_walk() -> None:
    walker = features.native
    assert walker is not None

    def broken(text: str) -> int:
        raise ZeroDivisionError(text)

    body = [{"role": "user", "content": "hello"}]
    with pytest.raises(ZeroDivisionError):
        walker.walk(body, 100, broken, features.estimate_tokens)
    with pytest.raises(TypeError):
        walker.walk(body, 100, lambda text: "many", features.estimate_tokens)  # type: ignore[arg-type,return-value]
    with pytest.raises(OverflowError):
        walker.walk(body * 4, 100, lambda text: 2**62, features.estimate_tokens)


def test_markers_it_cannot_match_are_refused_when_built() -> None:
    for code_markers in (("x",), ("café",), (7,)):
        with pytest.raises(ValueError):
            _features_walk.Walker(code_markers=code_markers, math_markers=(), math_symbols="",  # type: ignore[arg-type]
                                  exact_chars_per_message=1, scan_chars=1)
