"""The C reader of ASCII asks (classifier/_ask_cues.c) against cues.read_ask_text, its Python reference."""

from __future__ import annotations

import csv
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loadgen import payloads
from gateway.classifier import cues
from gateway.classifier.cues import ASK_SCAN_CHARS, OPENING_CHARS, Cues, read_ask_text, read_cues, split_ask
from gateway.cli.classifier_data import DEFAULT_SETS_PATH, read_manifest
from gateway.features import Features, extract
from tests.classifier.test_cues import CMMLU, FEW_SHOT, MMLU
from tests.fixtures.classifier_data import synthetic_rows

needs_native = pytest.mark.skipif(cues.native is None, reason="the optional C extension did not build")
ROOT = Path(__file__).resolve().parents[2]
ROUTING_DATA = ROOT / read_manifest(DEFAULT_SETS_PATH).data_dir  # the manifest's folder, from the repository

# Every word and phrase the reader is given, as written and capitalised (the ask is lowered before it is read)
LISTED = sorted(
    {
        form
        for listed in (cues.CODE_WORDS, cues.CODE_VERBS, cues.CODE_NOUNS, cues.MATH_WORDS, cues.MATH_PHRASE_WORDS,
                       cues.MATH_PHRASES, cues.LATEX, cues.OPEN_VERBS, cues.OPEN_NOUNS, cues.REASONING_WORDS,
                       cues.REASONING_PHRASES, cues.REASONING_PHRASE_WORDS, cues.NEGATIONS, cues.LETTER_ONLY,
                       cues.LETTER_ONLY_WORDS)
        for phrase in listed
        for form in (phrase, phrase.capitalize(), phrase.upper())
    }
)
# What the options, separators, whitespace (str.split()'s ASCII controls too), LaTeX and opening turn on
TRICKY = [
    *"ABCDEFGHIJKabcdefghijk.)]:([}$\\^{0123456789? \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\"'*#-_!,;+\x00\x7f",
    *("^{", "\nA. ", "\n(b) ", "\n[C] ", "\nD: ", " \tE) x", "$5", "\\frac", "A.", "\n"),
]
ASCII_TEXT = st.lists(st.sampled_from(LISTED) | st.sampled_from(TRICKY) | st.characters(max_codepoint=127),
                      max_size=60).map("".join)


def python_cues(features: Features) -> Cues:
    """read_cues with the C reader switched off: every ask read by read_ask_text."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cues, "_ascii_reader", None)
        return read_cues(features)


def chat(text: str) -> Features:
    return extract({"messages": [{"role": "user", "content": text}]}, "chat")


def routing_prompts() -> Iterator[str]:
    for labelled in read_manifest(DEFAULT_SETS_PATH).sets:
        with gzip.open(ROUTING_DATA / labelled.file, "rt", newline="") as rows:
            yield from (row["prompt"] for row in csv.DictReader(rows))


def prompts() -> Iterator[str]:
    """The repository's own prompts (the benchmark's 10,000, the synthetic training rows, the cue tests'), and
    the labelled routing data's ~25,000 where it is (beside the repository, not in it): never a skip."""
    yield from (json.loads(body)["messages"][0]["content"] for body in payloads(False))
    yield from (row["prompt"] for row in synthetic_rows(2_000))
    yield from (CMMLU, FEW_SHOT, MMLU)
    if ROUTING_DATA.is_dir():
        yield from routing_prompts()


@needs_native
def test_c_and_python_read_every_prompt_alike() -> None:
    # All of them, not a sample: both readings of all ~37,000 take a few seconds.
    read = read_in_c = differ = 0
    for prompt in prompts():
        features = chat(prompt)
        _, ask = split_ask(features.last_user_text)
        read += 1
        read_in_c += ask[-ASK_SCAN_CHARS:].isascii() and ask[:OPENING_CHARS].isascii()
        differ += read_cues(features) != python_cues(features)
    assert differ == 0
    assert read >= 12_000 and read_in_c >= 0.8 * read  # CMMLU's 2,000 Chinese prompts aside, C read them


@needs_native
@settings(max_examples=3000, deadline=None)
@given(ASCII_TEXT, ASCII_TEXT)
def test_c_reads_any_ascii_ask_as_python_does(tail: str, opening: str) -> None:
    assert cues._ascii_reader is not None
    assert cues._ascii_reader.read(tail, opening) == read_ask_text(tail, opening)


@needs_native
@settings(max_examples=500, deadline=None)
@given(ASCII_TEXT, st.integers(0, 40))
def test_c_reads_long_asks_as_python_does(text: str, repeats: int) -> None:
    # read_cues cuts the tail and the opening: the reader must agree across the cut, and past STACK_CHARS
    features = chat(text * repeats)
    assert read_cues(features) == python_cues(features)
    assert cues._ascii_reader is not None
    assert cues._ascii_reader.read(text * repeats, text) == read_ask_text(text * repeats, text)


class CountingReader:
    """The C reader, counting its calls: which path read_cues took."""

    def __init__(self, reader: Any) -> None:
        self.reader, self.calls = reader, 0

    def read(self, tail: str, opening: str) -> cues.AskText:
        self.calls += 1
        return self.reader.read(tail, opening)  # type: ignore[no-any-return]


@needs_native
@pytest.mark.parametrize(
    ("text", "in_c"),
    [
        (MMLU, True),
        (FEW_SHOT, True),
        (CMMLU, False),
        ("\u4f60\u597d. Write a poem." + " x" * 400 + "\nA. yes\nB. no", False),  # an opening in Chinese
        ("Write a poem." + " x" * 400 + "\nA. \u662f\nB. \u5426", False),  # a tail in Chinese
        ("Explain this. " + "x " * 20 + "\u4f60\u597d " * 20 + "x " * 400 + "Step by step.", True),  # between
    ],
    ids=["mmlu", "few-shot", "cmmlu", "chinese-opening", "chinese-tail", "chinese-middle"],
)
def test_ascii_asks_are_read_in_c_and_others_in_python(text: str, in_c: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = CountingReader(cues._ascii_reader)
    monkeypatch.setattr(cues, "_ascii_reader", spy)
    cues_read = read_cues(chat(text))
    assert spy.calls == int(in_c)
    assert cues_read == python_cues(chat(text))


def test_a_chinese_ask_reads_as_it_did_before_the_extension() -> None:
    # the cues main's read_cues gave before the C reader came in
    assert read_cues(chat(CMMLU)) == Cues(
        shots=0, ask_chars=44, options=4, letter_only=False, digits=0, latex=False, word_problem=False,
        code_request=False, open_ended=False, reasoning=False, negation=False, question_mark=False,
        cjk_share=13 / 22, word_chars=8.8, kind="choice", expected_answer_tokens=20,
    )


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI, a missing extension means the fallback")
def test_extension_builds_in_ci() -> None:
    assert cues._ascii_reader is not None, "the C extension did not build: asks would be read in Python"


@needs_native
def test_the_lists_come_from_the_caller() -> None:
    # The C file holds no list of its own: a reader given other words reads by them.
    lists: dict[str, Any] = {name: () for name in LIST_ARGUMENTS}
    reader = cues.native.AskReader(**dict(lists, code_words=["cobol", "\u51fd\u6570"], open_verbs=["port"]),
                                   separators=" ", opening_padding="")
    assert reader.read("in COBOL please", "Port it")[5:7] == (True, True)  # code_request, open_ended
    assert reader.read("in python please", "write it")[5:7] == (False, False)


LIST_ARGUMENTS = ("code_words", "code_verbs", "code_nouns", "math_words", "math_phrase_words", "open_nouns",
                  "reasoning_words", "reasoning_phrase_words", "negations", "letter_only_words", "math_phrases",
                  "reasoning_phrases", "letter_only", "latex", "open_verbs")


@needs_native
def test_the_reader_refuses_what_it_cannot_read() -> None:
    reader = cues._ascii_reader
    assert reader is not None
    with pytest.raises(ValueError, match="tail is not ASCII"):
        reader.read("caf\u00e9", "x")
    with pytest.raises(ValueError, match="opening is not ASCII"):
        reader.read("x", "caf\u00e9")
    with pytest.raises(TypeError, match="must be str"):
        reader.read(b"x", "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes the tail and the opening"):
        reader.read("x")  # type: ignore[call-arg]
    lists: dict[str, Any] = {name: () for name in LIST_ARGUMENTS}
    with pytest.raises(TypeError, match="code_nouns must hold str"):
        cues.native.AskReader(**dict(lists, code_nouns=[1]), separators="", opening_padding="")
    with pytest.raises(TypeError, match="iterable of str"):
        cues.native.AskReader(**dict(lists, latex=3), separators="", opening_padding="")
