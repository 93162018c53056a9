"""Cost of the routing brain's classifier path: features + score per request, and bounded huge prompts.

    .venv/bin/python -m bench.classifier_bench [--model MODEL] [--iterations N]

Prints p50/p99 (µs) of `extract` and `score` for a small chat and a 2,000-token prompt (token counts
cold, i.e. with the exact-count memo cleared, and warm, as a repeated system prompt would be), the
same scored by scikit-learn's transform + predict_proba for comparison, and `extract` on a 200k-token
prompt to show that its cost is bounded.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from gateway import features
from gateway.classifier import Classifier
from gateway.features import extract

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "an",
    "integral",
    "matrix",
    "function",
    "derivative",
    "server",
    "request",
    "latency",
    "python",
    "code",
    "error",
    "deploy",
    "build",
    "test",
    "value",
    "result",
    "because",
    "however",
    "therefore",
]


def prose(n_tokens: int, seed: int = 0) -> str:
    """Exactly n_tokens cl100k tokens of English-like text (when the encoding is available)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    encoding = tiktoken_encoding()
    return encoding.decode(encoding.encode_ordinary(text)[:n_tokens]) if encoding is not None else text


def tiktoken_encoding() -> Any:
    import tiktoken

    try:
        return tiktoken.get_encoding(features.ENCODING_NAME)
    except ValueError:
        return None


def percentiles_us(
    run: Callable[[], Any], iterations: int, before: Callable[[], None] | None = None
) -> tuple[float, float]:
    samples = []
    for _ in range(iterations):
        if before is not None:
            before()
        started = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - started) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def line(name: str, figures: tuple[float, float]) -> str:
    return f"{name:<46}{figures[0]:>10.1f}{figures[1]:>10.1f}"


def sklearn_scorer(model: Classifier) -> Callable[[features.Features], float]:
    """The same model scored through scikit-learn (the slow path the design avoids)."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from gateway.classifier_train import design_matrix

    estimator = LogisticRegression()
    estimator.classes_ = np.array([0, 1])
    n_numeric = len(model.numeric)
    estimator.coef_ = np.concatenate([model.text_coef, [n.coef for n in model.numeric]]).reshape(1, -1)
    estimator.intercept_ = np.array([model.intercept])
    assert estimator.coef_.shape[1] == model.text.n_features + n_numeric
    return lambda f: float(estimator.predict_proba(design_matrix(model, [f]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="JSON model (default: the packaged one)")
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    model = Classifier.load(args.model) if args.model else Classifier.default()
    features.load_encoding()
    small = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's a good name for a grey cat?"},
        ],
    }
    long_text = prose(2000)
    long = {"model": "m", "messages": [{"role": "user", "content": long_text}]}
    huge = {"model": "m", "messages": [{"role": "user", "content": prose(200_000, seed=1)}]}
    n = args.iterations
    cold = features.count_exact.cache_clear
    print(f"{'µs per request (' + str(n) + ' iterations)':<46}{'p50':>10}{'p99':>10}")
    for name, body in (("small chat", small), ("2,000-token prompt", long)):
        f = extract(body, "chat")
        print(
            f"-- {name}: prompt_tokens={f.prompt_tokens} exact={f.prompt_tokens_exact}, "
            f"classifier text {len(f.last_user_text)} chars, score {model.score(f):.3f}"
        )
        print(
            line("  extract (token counts cold)", percentiles_us(lambda b=body: extract(b, "chat"), n, cold))
        )
        print(line("  extract (token counts memoized)", percentiles_us(lambda b=body: extract(b, "chat"), n)))
        print(line("  score", percentiles_us(lambda f=f: model.score(f), n)))
        print(
            line(
                "  extract + score (cold)",
                percentiles_us(lambda b=body: model.score(extract(b, "chat")), n, cold),
            )
        )
        slow = sklearn_scorer(model)
        print(
            line(
                "  score via scikit-learn (for comparison)",
                percentiles_us(lambda f=f, slow=slow: slow(f), max(n // 10, 20)),
            )
        )
    f = extract(huge, "chat")
    chars = len(huge["messages"][0]["content"])
    estimated = not f.prompt_tokens_exact
    print(f"-- 200k-token prompt ({chars} chars): prompt_tokens={f.prompt_tokens} (estimated: {estimated})")
    print(line("  extract", percentiles_us(lambda: extract(huge, "chat"), max(n // 20, 20), cold)))
    print(
        line(
            "  extract + score",
            percentiles_us(lambda: model.score(extract(huge, "chat")), max(n // 20, 20), cold),
        )
    )


if __name__ == "__main__":
    main()
