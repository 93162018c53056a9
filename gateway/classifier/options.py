"""How the classifier is trained (the `classifier train|eval` flags), without the training code's imports.

Apart from the training module so that building the CLI's parser, which every command does (`serve`
included), does not load scikit-learn and scipy, whose import would add time and memory to every process
(docs/performance.md, 'Why the code is shaped so').
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.classifier.inputs import INPUTS
from gateway.classifier.vocabulary import CharNgrams

# Left out: the whole-prompt total (on single-turn data it equals last_user_tokens, and sharing weight with
# it would push every agent turn with a long system prompt to HQ; the parts are learned separately), and
# last_user_tokens, which next to ask_chars (its length in characters, worked examples apart) made the
# characters per token an input: "hi", two characters in one token, read as dense as code.
DEFAULT_NUMERIC = tuple(name for name in INPUTS if name not in ("prompt_tokens", "last_user_tokens"))
DEFAULT_TEXT = CharNgrams(ngram_min=4, ngram_max=4)


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    """How a model is fitted (the `classifier train|eval` flags); recorded in the artifact's meta."""

    text: CharNgrams = DEFAULT_TEXT
    # An n-gram enters the vocabulary when this many training prompts contain it: one-off n-grams
    # (numbers, names) would only memorize their prompt's label.
    min_df: int = 2
    use_text: bool = True  # False: structured inputs only (no n-gram block)
    c: float = 1.0  # inverse L2 strength
    # > 1 shrinks the structured inputs' scale, which weakens their L2 penalty against the n-grams.
    numeric_weight: float = 1.0
    # Rows where the fast deployment answered better weigh this much in the log loss: sending those to HQ
    # loses quality as well as money, so telling them apart from the true positives matters most.
    fast_wins_weight: float = 3.0
    numeric: tuple[str, ...] = DEFAULT_NUMERIC
    # "fast-fails": learn P(the fast deployment's answer is wrong), a label every row has and the one that
    # generalizes best across benchmarks here; "gap": P(HQ's answer is better than fast's)
    target: str = "fast-fails"


DEFAULT_OPTIONS = TrainingOptions()
TARGETS = ("fast-fails", "gap")
