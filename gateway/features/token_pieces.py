"""cl100k token counts of ASCII text from its pieces: split by Python's `re`, each piece's count memoized.

tiktoken splits a text into pieces with cl100k's pattern, run by fancy_regex's backtracking VM (the pattern has a
lookahead), then byte-pair encodes each piece. In a loaded gateway that costs more CPU for a ten-word prompt than
the rest of the features (docs/performance.md, 'Why the code is shaped so'). The pieces of everyday text recur
("explain", " the", " map"), so after the split a count is a dict lookup a piece. For ASCII text the pattern's
Unicode classes are plain ASCII sets, which Python's `re` runs (3.11 has the possessive quantifiers the pattern
uses): the same pieces, hence the same count as `len(encoding.encode_ordinary(text))`, which
tests/test_token_pieces.py checks against tiktoken on random and real text. Other text goes to tiktoken as before.
"""

from __future__ import annotations

import re
from typing import Protocol

# cl100k's pattern, '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|
# \s++$|\s*[\r\n]|\s+(?!\S)|\s, with its classes as they are on ASCII: \p{L} is A-Za-z, \p{N} is 0-9, and \s is
# Unicode's White_Space, whose ASCII members are these six (not Python's \s, which also takes \x1c-\x1f).
# Its `$` is the end of the text (Rust's, without the multi-line flag): `\Z` here, since Python's `$` also
# matches before a final newline.
_SPACE = r"\t\n\x0b\x0c\r "
_ASCII_PIECES = re.compile(
    r"'(?i:[sdmt]|ll|ve|re)"
    r"|[^\r\nA-Za-z0-9]?+[A-Za-z]++"
    r"|[0-9]{1,3}+"
    rf"| ?[^{_SPACE}A-Za-z0-9]++[\r\n]*+"
    rf"|[{_SPACE}]++\Z"
    rf"|[{_SPACE}]*[\r\n]"
    rf"|[{_SPACE}]+(?![^{_SPACE}])"
    rf"|[{_SPACE}]"
)
# Up to this length a text is counted from its pieces: below it tiktoken's fixed cost a call dominates; above it
# tiktoken's split is the faster (the two cost the same near this length: docs/performance.md, 'Why the code is
# shaped so'), and it releases the GIL.
PIECES_MAX_CHARS = 400
# Distinct pieces remembered; past this the memo starts over (a piece is a word or a run of symbols or
# spaces, so ~100 bytes an entry: a few MiB at most).
MEMO_PIECES = 32_768


class Encoding(Protocol):
    """The slice of tiktoken.Encoding the gateway uses."""

    def encode_ordinary(self, text: str) -> list[int]: ...

    def _encode_single_piece(self, text_or_bytes: str | bytes) -> list[int]: ...


class PieceCounter:
    """Exact cl100k token counts: short ASCII text piece by piece from a memo, other text by tiktoken."""

    __slots__ = ("_encoding", "_memo")

    def __init__(self, encoding: Encoding) -> None:
        self._encoding = encoding
        self._memo: dict[str, int] = {}

    def count(self, text: str) -> int:
        if len(text) > PIECES_MAX_CHARS or not text.isascii():
            return len(self._encoding.encode_ordinary(text))
        memo, total = self._memo, 0
        for piece in _ASCII_PIECES.findall(text):
            tokens = memo.get(piece)
            if tokens is None:
                tokens = self._learn(piece)
            total += tokens
        return total

    def _learn(self, piece: str) -> int:
        if len(self._memo) >= MEMO_PIECES:
            self._memo.clear()
        tokens = self._memo[piece] = len(self._encoding._encode_single_piece(piece.encode("ascii")))
        return tokens
