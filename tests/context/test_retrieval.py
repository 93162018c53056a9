"""Retrieval's pure half (gateway/context/retrieval.py): BM25 ranks by the step's rare words, a piece comes back
only with a lexical match and over min_score, within the budget and the count; the block names each piece and
goes after everything the client sent, in each API's form."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gateway.context.retrieval import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    CHAT,
    MESSAGES,
    RESPONSES,
    Candidate,
    RetrieveRule,
    block,
    bm25,
    choose,
    pieces_of_span,
    query_terms,
    query_text,
    terms,
)

PIECES = {
    "pytest": "tests/test_ratio.py::test_zero FAILED\nZeroDivisionError: division by zero in compute_ratio",
    "ls": "README.md\nsetup.py\nsrc\ntests",
    "cat": "def compute_ratio(a, b):\n    return a / b\n",
    "git": "commit 1f2e3d\nAuthor: someone\n    add the README",
}


def candidate(name: str, tokens: int = 100, cosine: float = 0.0) -> Candidate:
    counted = terms(PIECES[name])
    return Candidate(f"ctx_{name}", None, counted, sum(counted.values()), tokens, cosine)


def test_terms_are_lowercased_identifiers_and_long_numbers_but_common_words() -> None:
    assert terms("The ZeroDivisionError in compute_ratio at line 42, commit 12345; a b") == Counter(
        {"zerodivisionerror": 1, "compute_ratio": 1, "line": 1, "commit": 1, "12345": 1})


def test_the_query_weighs_identifiers_over_plain_words() -> None:
    assert query_terms("Fix the ZeroDivisionError in compute_ratio of src/ratio.py line 42") == Counter(
        {"fix": 1, "zerodivisionerror": 3, "compute_ratio": 3, "src": 1, "ratio": 1, "line": 1})


def test_bm25_ranks_the_pieces_holding_the_steps_rare_words_first() -> None:
    pieces = [candidate(name) for name in PIECES]
    scores = bm25(query_terms("fix the ZeroDivisionError in compute_ratio"), pieces)
    ranked = [p.ref for _, p in sorted(zip(scores, pieces, strict=True), key=lambda x: -x[0])]
    assert ranked[:2] == ["ctx_pytest", "ctx_cat"]
    assert scores[1] == scores[3] == 0.0  # ls and git share no word with the query


def test_choose_keeps_to_lexical_matches_min_score_budget_and_count() -> None:
    pieces = [candidate("pytest", 600), candidate("ls"), candidate("cat", 500), candidate("git")]
    query = query_terms("fix the ZeroDivisionError in compute_ratio")
    chosen = choose(pieces, query, RetrieveRule(budget_tokens=2_000, max_documents=3, min_score=0.1), False)
    assert [c.candidate.ref for c in chosen] == ["ctx_pytest", "ctx_cat"]
    assert [c.score for c in chosen] == [1.0, 0.5]  # both identifiers, then compute_ratio alone
    assert [c.candidate.ref for c in choose(pieces, query, RetrieveRule(2_000, 3, 0.6), False)] == ["ctx_pytest"]
    assert choose(pieces, query, RetrieveRule(budget_tokens=1_000, max_documents=3, min_score=0.1), False)[-1] \
        .candidate.ref == "ctx_pytest"  # 600 + 500 over a budget of 1,000: the second does not fit
    assert len(choose(pieces, query, RetrieveRule(2_000, 1, 0.1), False)) == 1
    assert choose(pieces, query_terms("nothing alike here"), RetrieveRule(), False) == []


def test_with_embeddings_the_score_averages_the_identifier_coverage_and_the_cosine() -> None:
    pieces = [candidate("pytest", cosine=0.9), candidate("cat", cosine=0.1)]
    query = query_terms("ZeroDivisionError compute_ratio")
    chosen = choose(pieces, query, RetrieveRule(min_score=0.0), True)
    assert chosen[0].score == pytest.approx((1.0 + 0.9) / 2, abs=1e-4)
    assert chosen[1].score == pytest.approx((0.5 + 0.1) / 2, abs=1e-4)
    # a semantic match alone brings nothing back: the ls listing has no word of the query
    assert [c.candidate.ref for c in choose([candidate("ls", cosine=0.99)], query, RetrieveRule(min_score=0.0),
                                            True)] == []


def test_the_block_is_delimited_names_each_piece_and_goes_last_in_each_api() -> None:
    text = block([("ctx_a", None, "first"), ("ctx_b", 4, "second")])
    assert text.startswith(BLOCK_OPEN) and text.endswith(BLOCK_CLOSE)
    assert "--- ctx_a ---\nfirst" in text and "--- ctx_b entry 4 ---\nsecond" in text
    chat = CHAT.with_block({"messages": [{"role": "tool", "tool_call_id": "c", "content": "ok"}]}, text)
    assert chat["messages"][-1] == {"role": "user", "content": text}
    items = RESPONSES.with_block({"input": [{"type": "function_call_output", "call_id": "c", "output": "ok"}]}, text)
    assert items["input"][-1]["content"] == [{"type": "input_text", "text": text}]
    results = [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]
    messages = MESSAGES.with_block({"messages": [{"role": "user", "content": results}]}, text)
    assert messages["messages"] == [{"role": "user", "content": [*results, {"type": "text", "text": text}]}]
    after_assistant = MESSAGES.with_block({"messages": [{"role": "assistant", "content": "hi"}]}, text)
    assert after_assistant["messages"][-1] == {"role": "user", "content": [{"type": "text", "text": text}]}


def test_a_spans_pieces_are_its_entries_words_without_ids() -> None:
    entries = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\": \"pytest\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 failed"}]
    assert pieces_of_span(json.dumps(entries).encode()) == ["shell\n{\"cmd\": \"pytest\"}", "1 failed"]
    assert pieces_of_span(b"not json") == ["not json"]


def test_the_query_reads_the_newest_messages_and_their_tool_calls() -> None:
    view = {"messages": [{"role": "user", "content": "old task"}, {"role": "assistant", "content": "thinking"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"function": {"name": "shell", "arguments": "{\"cmd\": \"pytest -x\"}"}}]},
                         {"role": "tool", "content": "ZeroDivisionError"}]}
    assert query_text(view) == "thinking\nshell {\"cmd\": \"pytest -x\"}\nZeroDivisionError"


def test_on_this_repositorys_code_the_right_piece_ranks_first_and_min_score_separates() -> None:
    """python -m evals.retrieval with wordllama's real embeddings: tracebacks through one module among ten."""
    from evals.retrieval.__main__ import measure

    found = measure(seed=2, limit=80)
    assert found["cases"] > 40 and found["best_is_right"] >= 0.85
    at_default = found["thresholds"][str(RetrieveRule().min_score)]
    assert at_default["positive_found"] >= 0.7 and at_default["negative_brought_back"] <= 0.3
