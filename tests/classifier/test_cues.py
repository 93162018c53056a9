"""Task cues read from requests: the ask after worked examples, options, code, math, kind, expected length."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.classifier.cues import (
    _SEPARATORS,
    ASK_SCAN_CHARS,
    NO_CUES,
    Cues,
    _digits,
    _words,
    read_cues,
    split_ask,
)
from gateway.features import LAST_USER_TEXT_CHARS, extract

MMLU = "Find the degree of Q(sqrt(2), sqrt(3)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:"
FEW_SHOT = (
    "Which gas do plants take in?\nA) oxygen\nB) carbon dioxide\nPrint only a single choice from \"A\" or \"B\" "
    "without explanation.\nAnswer:\nB\n\nWhat melts ice fastest?\nA) salt\nB) sand\nPrint only a single choice "
    "from \"A\" or \"B\" without explanation.\nAnswer:\nA\n\nWhich is a mammal?\nA) whale\nB) shark\nPrint only "
    "a single choice from \"A\" or \"B\" without explanation.\nAnswer:"
)
GSM8K = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many clips did she sell?"
MBPP = "Write a python function to remove first and last occurrence of a given character from the string."
HUMANEVAL = 'def add(a, b):\n    """Add two numbers.\n    >>> add(2, 3)\n    5\n    """\n'
LATEX = "Simplify $\\frac{91}{26}.$"
ESSAY = "Write a short essay on the history of the printing press."
TRIVIA = "Question:Which object in the sky is a satellite of the planet Earth?\nAnswer:"
CMMLU = "运行中变压器温度最高的部分是\nA. 绕组\nB. 变压器油\nC. 引线\nD. 铁芯\n答案\uff1a"


def cues_of(text: str, **extra: Any) -> Cues:
    return read_cues(extract({"messages": [{"role": "user", "content": text}], **extra}, "chat"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MMLU, {"kind": "choice", "options": 4, "shots": 0, "letter_only": False, "expected_answer_tokens": 20}),
        (FEW_SHOT, {"kind": "choice", "options": 2, "shots": 2, "letter_only": True, "expected_answer_tokens": 2}),
        (GSM8K, {"kind": "math", "word_problem": True, "digits": 2, "options": 0, "question_mark": True}),
        (MBPP, {"kind": "code", "code_request": True, "expected_answer_tokens": 200}),
        (HUMANEVAL, {"kind": "code", "code_request": True}),
        (LATEX, {"kind": "math", "latex": True, "expected_answer_tokens": 150}),
        (ESSAY, {"kind": "open", "open_ended": True, "expected_answer_tokens": 400}),
        (TRIVIA, {"kind": "question", "options": 0, "open_ended": False, "expected_answer_tokens": 60}),
        (CMMLU, {"kind": "choice", "options": 4}),
    ],
    ids=["mmlu", "few-shot", "gsm8k", "mbpp", "humaneval", "latex", "essay", "trivia", "cmmlu"],
)
def test_cues_of_benchmark_shapes(text: str, expected: dict[str, Any]) -> None:
    cues = cues_of(text)
    assert {k: getattr(cues, k) for k in expected} == expected


def test_the_ask_is_what_follows_the_last_worked_example() -> None:
    shots, ask = split_ask(FEW_SHOT)
    assert shots == 2
    assert ask.strip().startswith("A\n\nWhich is a mammal?") and ask.endswith("Answer:")
    assert split_ask(MMLU) == (0, MMLU)  # one "Answer:" is a closing line, not a repeat
    assert split_ask("") == (0, "")
    assert cues_of(FEW_SHOT).ask_chars == len(ask) < len(FEW_SHOT)


def test_worked_examples_given_as_chat_turns_count_too() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Answer with the letter."},
            {"role": "user", "content": "2+2?\nA. 4\nB. 5"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "3+3?\nA. 5\nB. 6"},
            {"role": "assistant", "content": "B"},
            {"role": "user", "content": "4+4?\nA. 8\nB. 9"},
        ]
    }
    cues = read_cues(extract(body, "chat"))
    assert (cues.shots, cues.kind, cues.options) == (2, "choice", 2)


def test_script_share_and_word_length() -> None:
    assert cues_of(CMMLU).cjk_share > 0.5
    assert cues_of(MMLU).cjk_share == 0.0
    assert cues_of("the cat sat on the mat").word_chars == pytest.approx(22 / 6)


def test_max_tokens_caps_the_expected_answer() -> None:
    assert cues_of(ESSAY, max_tokens=50).expected_answer_tokens == 50
    assert cues_of(ESSAY, max_tokens=5000).expected_answer_tokens == 400


def test_prose_that_mentions_a_word_is_not_a_request() -> None:
    cues = cues_of("He hurt himself. Which of these is a mammal: whale or shark?")
    assert not cues.code_request and cues.kind == "question"


def test_a_huge_prompt_is_read_within_bounds() -> None:
    """Features keep at most LAST_USER_TEXT_CHARS of the turn; the scans read ASK_SCAN_CHARS of the ask."""
    text = "Explain the following log.\n" + "x = 1; y = 2\n" * 100_000 + "Why did it fail?"
    cues = cues_of(text)
    assert cues.ask_chars <= LAST_USER_TEXT_CHARS
    assert cues.question_mark and cues.ask_chars > ASK_SCAN_CHARS


def test_no_cues_is_a_complete_placeholder() -> None:
    assert isinstance(NO_CUES, Cues) and NO_CUES.kind == "question"


def test_an_open_ended_ask_is_read_from_its_first_words_however_long() -> None:
    cues = cues_of("Summarize the following report.\n\n" + "The committee met on Tuesday. " * 60)
    assert cues.open_ended and cues.kind == "open" and cues.ask_chars > 1_000


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=80)
       | st.text(alphabet=st.sampled_from("ab1 9\x1c\x1f\u00a0\u0663\u3000\u2028,.\n\t\ud800"), max_size=40)
       | st.text(max_size=40))
def test_the_words_and_digits_are_those_of_the_plain_definitions(text: str) -> None:
    # The ASCII fast path (a byte table) must split and count as str.translate and str.count do, for any text:
    # the ASCII control separators str.split() splits at, non-ASCII digits and spaces, a lone surrogate.
    lowered = text.lower()
    assert _words(lowered) == set(lowered.translate(_SEPARATORS).split())
    assert _digits(text) == sum(map(text.count, "0123456789"))
