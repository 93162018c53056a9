"""What a request asks for, read from its features: the task cues the classifier weighs across kinds of task.

The optional C extension gateway.native._ask_cues reads an ASCII ask when it built: inside the running gateway
the Python reading cost a request a noticeable share of its CPU (cache misses across the small objects it makes and
walks; docs/performance.md, 'Why the code is shaped so'); read_ask_text here is the reference the extension is tested
against, and reads every other ask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.features import Features
from gateway.native import ask_cues as native  # None: read_ask_text reads every ask

# The cues read the ask's last characters, where its question, options and instructions are.
ASK_SCAN_CHARS = 600
OPENING_CHARS = 40  # an open-ended ask opens with its verb ("Write", "Explain") in these characters
OPENING_PADDING = " \t\n\"'*#-"  # what may come before the verb: quotes, a markdown bullet or heading
# A closing line this short is an answer cue ("Answer:", "A:") only when it is one of these words.
ANSWER_CUES = frozenset({"answer", "a", "answer is", "output", "solution", "response", "答案"})
MIN_REPEATED_LINE_CHARS = 6
# An answer's expected length in tokens by kind of task: priors written down, not fitted to any data.
EXPECTED_ANSWER_TOKENS = {"letter": 2, "choice": 20, "question": 60, "math": 150, "code": 200, "open": 400}
KINDS = ("choice", "code", "math", "open", "question")

# "A. ...", "(b) ...", "C) ...", "D\uff1a..." (a fullwidth colon) opening a line: a multiple-choice option
_OPTION = re.compile(r"(?m)^[ \t]*[(\[]?([A-Ja-j])[.)\]:\uff1a\u3001\uff0e][ \t]*\S")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
# Words are looked up in the set of the ask's words, and phrases are substring tests: an alternation of
# them in re costs 10-100 times more, since re tries every alternative at every position.
_SEPARATOR_CHARS = "!\"%&'()*,-./:;<=>?@[\\]^_`{|}~\n\t0123456789"
_SEPARATORS = str.maketrans(dict.fromkeys(_SEPARATOR_CHARS, " "))
# The same for an ASCII ask, as a byte table: str.translate looks each character up in a dict,
# bytes.translate indexes a table.
_ASCII_SEPARATORS = bytes(32 if chr(b) in _SEPARATOR_CHARS else b for b in range(256))
_DIGITS = b"0123456789"
CODE_WORDS = frozenset({"python", "javascript", "typescript", "java", "sql", "regex", "def", "const", "c++", "bash"})
CODE_VERBS = frozenset({"write", "implement", "complete", "fix", "debug", "refactor"})
CODE_NOUNS = frozenset({"function", "functions", "program", "script", "code", "algorithm", "method"})
MATH_WORDS = frozenset(
    {"average", "percent", "percentage", "calculate", "compute", "solve", "simplify", "evaluate", "total", "remainder"}
)
MATH_PHRASES = ("how many", "how much", "how long", "how far", "how old", "how fast", "find the", "express your answer")
# A phrase is looked for only when one of its words is in the ask: most asks have none, and the word test
# is one set lookup against up to ten substring scans.
MATH_PHRASE_WORDS = frozenset({"how", "find", "express"})
LATEX = ("\\frac", "\\dfrac", "\\sqrt", "\\cdot", "\\times", "\\le", "\\ge", "\\pi", "^{")
OPEN_VERBS = (
    "write",
    "explain",
    "describe",
    "compose",
    "create",
    "generate",
    "summarize",
    "summarise",
    "list",
    "give",
    "draft",
    "discuss",
    "compare",
    "suggest",
    "design",
    "plan",
    "tell",
    "imagine",
    "rewrite",
    "translate",
    "brainstorm",
    "please",
)
OPEN_NOUNS = frozenset(
    {"essay", "story", "poem", "email", "blog", "article", "outline", "paragraph", "speech", "tweet"}
)
REASONING_WORDS = frozenset({"prove", "derive", "justify", "reasoning"})
REASONING_PHRASES = ("step by step", "step-by-step", "explain your", "show your work")
REASONING_PHRASE_WORDS = frozenset({"step", "explain", "show"})
NEGATIONS = frozenset({"not", "except", "least", "false"})
LETTER_ONLY = (
    "without explanation",
    "single choice",
    "single letter",
    "single word",
    "letter of the correct",
    "answer with only",
    "answer with the letter",
    "only the letter",
    "true or false",
    "yes or no",
)
LETTER_ONLY_WORDS = frozenset({"explanation", "single", "letter", "only", "true", "yes"})


# Cues's fields that the ask's text gives, in Cues's order: options, letter_only, digits, latex, word_problem,
# code_request, open_ended, reasoning, negation, question_mark, cjk_share, word_chars. A plain tuple: the C reader
# builds one directly, and read_cues unpacks it at once.
AskText = tuple[int, bool, int, bool, bool, bool, bool, bool, bool, bool, float, float]


@dataclass(slots=True)
class Cues:
    """The ask (the last user turn after its worked examples) and what it asks for.

    Treated as immutable; not frozen because a frozen dataclass sets its fields through object.__setattr__,
    which costs microseconds per request (see Features).
    """

    shots: int  # worked examples before the ask: in the text, or as earlier assistant turns
    ask_chars: int
    options: int  # distinct option letters opening lines of the ask (2+: a choice among given options)
    letter_only: bool  # the answer is asked for bare: a letter, a word, yes or no
    digits: int
    latex: bool
    word_problem: bool
    code_request: bool
    open_ended: bool
    reasoning: bool  # "step by step", "prove", "justify"
    negation: bool  # "NOT", "EXCEPT": the question turns on a negation
    question_mark: bool
    cjk_share: float  # share of the ask's characters in Chinese, Japanese or Korean script
    word_chars: float  # characters per space-separated word: long words are technical vocabulary
    kind: str  # one of KINDS
    expected_answer_tokens: int


# What a model that reads no cues is given in their place (its inputs with a weight never look).
NO_CUES = Cues(
    shots=0,
    ask_chars=0,
    options=0,
    letter_only=False,
    digits=0,
    latex=False,
    word_problem=False,
    code_request=False,
    open_ended=False,
    reasoning=False,
    negation=False,
    question_mark=False,
    cjk_share=0.0,
    word_chars=0.0,
    kind="question",
    expected_answer_tokens=0,
)


# The C reader of ASCII asks, given the lists above once: they stay written in one place.
_ascii_reader = None if native is None else native.AskReader(
    code_words=CODE_WORDS,
    code_verbs=CODE_VERBS,
    code_nouns=CODE_NOUNS,
    math_words=MATH_WORDS,
    math_phrase_words=MATH_PHRASE_WORDS,
    open_nouns=OPEN_NOUNS,
    reasoning_words=REASONING_WORDS,
    reasoning_phrase_words=REASONING_PHRASE_WORDS,
    negations=NEGATIONS,
    letter_only_words=LETTER_ONLY_WORDS,
    math_phrases=MATH_PHRASES,
    reasoning_phrases=REASONING_PHRASES,
    letter_only=LETTER_ONLY,
    latex=LATEX,
    open_verbs=OPEN_VERBS,
    separators=_SEPARATOR_CHARS,
    opening_padding=OPENING_PADDING,
)


def split_ask(text: str) -> tuple[int, str]:
    """(worked examples, the ask): few-shot prompts repeat their closing line ("Answer:") after each example,
    and the ask is what follows the last repeat before the end."""
    text = text.rstrip()
    newline = text.rfind("\n")
    closing = text[newline + 1 :].strip()
    if len(closing) < MIN_REPEATED_LINE_CHARS and closing.lower().rstrip(":\uff1a") not in ANSWER_CUES:
        return 0, text
    repeats = text.count(closing)
    if repeats < 2:
        return 0, text
    previous = text.rfind(closing, 0, newline + 1)
    return repeats - 1, text[previous + len(closing) :]


def read_cues(features: Features) -> Cues:
    """The cues of a request; bounded cost (the last user text is at most 2,000 characters, scans read 600)."""
    shots, ask = split_ask(features.last_user_text)
    tail = ask[-ASK_SCAN_CHARS:]
    opening = ask[:OPENING_CHARS]  # the ask's first words, however long it is
    if _ascii_reader is not None and tail.isascii() and opening.isascii():  # isascii() reads a flag
        text = _ascii_reader.read(tail, opening)
    else:
        text = read_ask_text(tail, opening)
    options, letter_only, _, latex, word_problem, code_request, open_ended, *_ = text
    kind = _kind(features, options, code_request, latex or word_problem, open_ended)
    expected = EXPECTED_ANSWER_TOKENS["letter" if kind == "choice" and letter_only else kind]
    if features.max_tokens:
        expected = min(expected, features.max_tokens)
    # Positional: the ask's text gives the fields from options to word_chars in Cues's order (AskText); a class
    # called with keywords gets them as a dict built per call, on every request.
    return Cues(shots + (features.prior_answers or 0), len(ask), *text, kind, expected)


def read_ask_text(tail: str, opening: str) -> AskText:
    """What the ask's scanned tail and opening say, in Python: the reference the C reader is tested against,
    and the reader of asks that are not ASCII (or of every ask, where the extension did not build)."""
    lowered = tail.lower()
    words = _words(lowered)
    options = len({letter.upper() for letter in _OPTION.findall(tail)})
    code_request = not CODE_WORDS.isdisjoint(words) or (
        not CODE_VERBS.isdisjoint(words) and not CODE_NOUNS.isdisjoint(words)
    )
    latex = tail.count("$") >= 2 or (("\\" in tail or "^{" in tail) and _any(tail, LATEX))
    word_problem = (
        "$" in tail
        or not MATH_WORDS.isdisjoint(words)
        or (not MATH_PHRASE_WORDS.isdisjoint(words) and _any(lowered, MATH_PHRASES))
    )
    opens_with_verb = opening.lower().lstrip(OPENING_PADDING).startswith(OPEN_VERBS)
    open_ended = options < 2 and (opens_with_verb or not OPEN_NOUNS.isdisjoint(words))
    letter_only = not LETTER_ONLY_WORDS.isdisjoint(words) and _any(lowered, LETTER_ONLY)
    reasoning = not REASONING_WORDS.isdisjoint(words) or (
        not REASONING_PHRASE_WORDS.isdisjoint(words) and _any(lowered, REASONING_PHRASES)
    )
    cjk_share = 0.0 if tail.isascii() else len(_CJK.findall(tail)) / len(tail)
    return (options, letter_only, _digits(tail), latex, word_problem, code_request, open_ended, reasoning,
            not NEGATIONS.isdisjoint(words), "?" in tail, cjk_share, len(tail) / (tail.count(" ") + 1))


def _words(lowered: str) -> set[str]:
    """The ask's words: split at whitespace, punctuation and digits."""
    if lowered.isascii():
        return set(lowered.encode().translate(_ASCII_SEPARATORS).decode().split())
    return set(lowered.translate(_SEPARATORS).split())


def _digits(text: str) -> int:
    """How many ASCII digits the text holds (in UTF-8 their bytes stand for nothing else)."""
    raw = text.encode("utf-8", "surrogatepass")
    return len(raw) - len(raw.translate(None, _DIGITS))


def _any(text: str, phrases: tuple[str, ...]) -> bool:
    # a loop, not any() over a generator: half the time for a few short tests
    for phrase in phrases:  # noqa: SIM110
        if phrase in text:
            return True
    return False


def _kind(features: Features, options: int, code_request: bool, mathy: bool, open_ended: bool) -> str:
    """The kind of task, first match wins: options make a choice; a request for code, math, open writing."""
    if options >= 2:
        return "choice"
    if code_request:
        return "code"
    if mathy or features.has_math:
        return "math"
    if features.has_code:
        return "code"
    return "open" if open_ended else "question"
