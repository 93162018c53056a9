"""The task cues of an ASCII ask in C (gateway/native/_ask_cues.c), from the word and phrase lists of cues.py."""

from collections.abc import Iterable

class AskReader:
    """cues.py's word and phrase lists, copied (strings that are not ASCII are dropped: no ASCII ask holds one)."""

    def __new__(
        cls,
        code_words: Iterable[str],
        code_verbs: Iterable[str],
        code_nouns: Iterable[str],
        math_words: Iterable[str],
        math_phrase_words: Iterable[str],
        open_nouns: Iterable[str],
        reasoning_words: Iterable[str],
        reasoning_phrase_words: Iterable[str],
        negations: Iterable[str],
        letter_only_words: Iterable[str],
        math_phrases: Iterable[str],
        reasoning_phrases: Iterable[str],
        letter_only: Iterable[str],
        latex: Iterable[str],
        open_verbs: Iterable[str],
        separators: str,
        opening_padding: str,
    ) -> AskReader: ...
    def read(
        self, tail: str, opening: str, /
    ) -> tuple[int, bool, int, bool, bool, bool, bool, bool, bool, bool, float, float]:
        """cues.AskText of an ASCII tail and opening, equal to cues.read_ask_text(tail, opening); ValueError if
        either is not ASCII."""
