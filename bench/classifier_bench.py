"""Cost of the routing brain's classifier path: features + score per request, and bounded huge prompts.

    .venv/bin/python -m bench.classifier_bench [--model MODEL] [--iterations N]

Prints p50/p99 (µs) of `extract` and `score` (and of the task cues `score` reads) for a small chat, a
2,000-token prompt and a 2,000-token conversation of six turns (token counts cold, i.e. with the
exact-count memo cleared, and warm, as a repeated system prompt would be), the
same scored by scikit-learn's transform + predict_proba for comparison, `score` over 10,000 distinct
short prompts (so that nothing keyed by the prompt can help), `extract` on a 200k-token prompt to
show that its cost is bounded, and the text logit's two paths (the C extension and its Python twin, the dict
walk) side by side.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

from gateway import features
from gateway.classifier.cues import read_cues
from gateway.classifier.scoring import Classifier
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


def _extract_and_score(model: Classifier, body: dict[str, Any]) -> float:
    return model.score(extract(body, "chat"))


def line(name: str, figures: tuple[float, float]) -> str:
    return f"{name:<46}{figures[0]:>10.1f}{figures[1]:>10.1f}"


def sklearn_scorer(model: Classifier) -> Callable[[features.Features], float]:
    """The same model scored through scikit-learn (the slow path the design avoids): CountVectorizer over
    the vocabulary, l2 normalize, predict_proba; the vectorizer is built once, as a server would."""
    import numpy as np
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import normalize

    from gateway.classifier.training import numeric_matrix, vectorizer

    counter = vectorizer(model.text, list(model.text_weights))
    estimator = LogisticRegression()
    estimator.classes_ = np.array([0, 1])
    estimator.coef_ = np.array([*model.text_weights.values(), *(n.coef for n in model.numeric)]).reshape(1, -1)
    estimator.intercept_ = np.array([model.intercept])
    means = np.array([n.mean for n in model.numeric])
    scales = np.array([n.scale for n in model.numeric])

    def score(f: features.Features) -> float:
        text = normalize(counter.transform([model.text.clip(f.last_user_text)]))
        numeric = (numeric_matrix([f], [n.name for n in model.numeric]) - means) / scales
        return float(estimator.predict_proba(sp.hstack([text, numeric]).tocsr())[0, 1])

    return score


def distinct_prompts(count: int, seed: int = 0) -> list[features.Features]:
    """Short chat prompts of about 45 characters, all different, the shape most gateway calls have."""
    rng = random.Random(seed)
    verbs = ["explain", "describe", "summarize", "compare", "define"]
    topics = ["a hash map", "quicksort", "TCP slow start", "a B-tree", "gradient descent", "DNS", "a mutex"]
    manners = ["briefly", "simply", "in detail", "for a child", "with an example"]
    texts = [f"Request {i}: {rng.choice(verbs)} {rng.choice(topics)} {rng.choice(manners)}." for i in range(count)]
    return [extract({"messages": [{"role": "user", "content": text}]}, "chat") for text in texts]


def each_once_us(run: Callable[[Any], Any], items: list[Any]) -> tuple[float, float, float]:
    """p50, p99 and mean (µs) of run(item), each item once: nothing warmed by an earlier call on it."""
    samples = []
    for item in items:
        started = time.perf_counter_ns()
        run(item)
        samples.append((time.perf_counter_ns() - started) / 1e3)
    mean = statistics.fmean(samples)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)], mean


def text_logit_paths(model: Classifier, iterations: int) -> None:
    """Mean µs per text logit (best of 5 batches: below a µs, timing each call would mostly time the clock)."""
    block = model.text_block
    paths = {
        "C extension": block._table.logit if block._table is not None else None,
        "dict walk (its Python twin)": block.dict_logit,
    }
    print(f"-- text logit by path, mean µs per preprocessed prompt (C extension built: {block._table is not None})")
    for chars in (40, 250, 1_000):
        text = block.text.preprocess(prose(400)[:chars])
        for name, run in paths.items():
            if run is not None:
                best = min(timeit.repeat(functools.partial(run, text), number=iterations, repeat=5))
                print(f"  {len(text):>5} chars, {name:<33}{best / iterations * 1e6:>10.2f}")


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
    turns = [("system", 150), ("user", 300), ("assistant", 400), ("user", 300), ("assistant", 350), ("user", 500)]
    conversation = {
        "model": "m",
        "messages": [{"role": role, "content": prose(tokens, seed=i)} for i, (role, tokens) in enumerate(turns)],
    }
    huge: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prose(200_000, seed=1)}]}
    n = args.iterations
    cold = features.count_exact.cache_clear
    print(f"{'µs per request (' + str(n) + ' iterations)':<46}{'p50':>10}{'p99':>10}")
    for name, body in (("small chat", small), ("2,000-token prompt", long), ("2,000-token conversation", conversation)):
        f = extract(body, "chat")
        print(
            f"-- {name}: prompt_tokens={f.prompt_tokens} exact={f.prompt_tokens_exact}, "
            f"classifier text {len(f.last_user_text)} chars, score {model.score(f):.3f}"
        )
        print(
            line("  extract (token counts cold)", percentiles_us(functools.partial(extract, body, "chat"), n, cold))
        )
        print(line("  extract (token counts memoized)", percentiles_us(functools.partial(extract, body, "chat"), n)))
        print(line("  score", percentiles_us(functools.partial(model.score, f), n)))
        print(line("  of which the task cues (read_cues)", percentiles_us(functools.partial(read_cues, f), n)))
        print(
            line(
                "  extract + score (cold)",
                percentiles_us(functools.partial(_extract_and_score, model, body), n, cold),
            )
        )
        slow = sklearn_scorer(model)
        print(
            line(
                "  score via scikit-learn (for comparison)",
                percentiles_us(functools.partial(slow, f), max(n // 10, 20)),
            )
        )
    prompts = distinct_prompts(10_000)
    print(f"-- 10,000 distinct short prompts (e.g. {prompts[0].last_user_text!r}), each scored once")
    p50, p99, mean = each_once_us(model.score, prompts)
    print(line("  score", (p50, p99)) + f"   mean {mean:.1f}")
    f = extract(huge, "chat")
    chars = len(huge["messages"][0]["content"])
    estimated = not f.prompt_tokens_exact
    print(f"-- 200k-token prompt ({chars} chars): prompt_tokens={f.prompt_tokens} (estimated: {estimated})")
    print(line("  extract", percentiles_us(functools.partial(extract, huge, "chat"), max(n // 20, 20), cold)))
    print(
        line(
            "  extract + score",
            percentiles_us(lambda: model.score(extract(huge, "chat")), max(n // 20, 20), cold),
        )
    )
    text_logit_paths(model, n)


if __name__ == "__main__":
    main()
