"""The classifier's text logit in C (gateway/native/_ngram_score.c), over an open-addressing n-gram table."""

from typing import Final

from typing_extensions import Buffer

MAX_NGRAM: Final[int]

class Table:
    """The vocabulary as an open-addressing table; the arrays (any C-contiguous buffers) are checked and copied."""

    def __new__(
        cls,
        ascii_ids: Buffer,
        alphabet: Buffer,
        keys: Buffer,
        weights: Buffer,
        ngram_min: int,
        ngram_max: int,
    ) -> Table: ...
    def logit(self, text: str, /) -> float:
        """w . x / ||x|| over the text's vocabulary n-grams (0.0 when it has none)."""
