"""`python -m evals.retrieval`: how well retrieval's scoring finds the piece a step is about, on this repository's
own code as the offloaded tool outputs (`cat` of a module), with wordllama's real embeddings.

Each case is a step whose newest message is a traceback through a function of one module: its candidates are
ten modules' texts (their first 6,000 characters, as a masked `cat` would hold). Positive cases hold the module
the traceback names among nine others; negative ones hold ten others (the step is about nothing offloaded).
Prints how often the best-ranked piece is the right one, and, for each min_score, the share of positive cases
whose right piece comes back and of negative cases that bring a piece back anyway.

    python -m evals.retrieval [--seed N] [--modules N] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.context.retrieval import Candidate, RetrieveRule, choose, piece_terms, query_terms
from gateway.server.retrieval import load_wordllama

ROOT = Path(__file__).resolve().parents[2]
PIECE_CHARS = 6_000
THRESHOLDS = (0.35, 0.4, 0.45, 0.5, 0.55)
_DEF = re.compile(r"^def ([a-z_]{6,})\(", re.MULTILINE)


def modules(limit: int) -> list[Path]:
    return [p for p in sorted((ROOT / "gateway").rglob("*.py")) if p.stat().st_size > 3_000][:limit]


def traceback(path: Path, function: str) -> str:
    return (f'Traceback (most recent call last):\n  File "{path.relative_to(ROOT)}", line 40, in {function}\n'
            f"ValueError: bad value in {function}")


def measure(seed: int, limit: int) -> dict[str, Any]:
    paths = modules(limit)
    texts = [p.read_text()[:PIECE_CHARS] for p in paths]
    model = load_wordllama()
    if model is None:
        raise SystemExit("wordllama is not installed (scripts/setup installs it)")
    vectors = _units(model.embed(texts))
    rng = random.Random(seed)
    positive: list[tuple[bool, float]] = []  # (the best-ranked is right, the right piece's score or -1)
    negative: list[float] = []  # the best-ranked piece's score
    for i, path in enumerate(paths):
        functions = _DEF.findall(texts[i])
        if not functions:
            continue
        query = traceback(path, rng.choice(functions))
        weighted, vector = query_terms(query), _units(model.embed([query]))[0]
        others = [j for j in range(len(paths)) if j != i]
        for holds_it in (True, False):
            pool = ([i] if holds_it else []) + rng.sample(others, 9 if holds_it else 10)
            candidates = [_candidate(j, texts[j], _dot(vector, vectors[j])) for j in pool]
            ranked = choose(candidates, weighted, RetrieveRule(10**6, len(candidates), 0.0), True)
            if holds_it:
                right = next((c.score for c in ranked if c.candidate.ref == str(i)), -1.0)
                positive.append((bool(ranked) and ranked[0].candidate.ref == str(i), right))
            else:
                negative.append(ranked[0].score if ranked else -1.0)
    return {"modules": len(paths), "cases": len(positive), "best_is_right": sum(r for r, _ in positive) / len(positive),
            "thresholds": {str(t): {"positive_found": sum(s >= t for _, s in positive) / len(positive),
                                    "negative_brought_back": sum(s >= t for s in negative) / len(negative)}
                           for t in THRESHOLDS}}


def _candidate(j: int, text: str, cosine: float) -> Candidate:
    kept, length = piece_terms(text)  # as the gateway's index keeps them
    return Candidate(str(j), None, kept, length, len(text) // 4, max(cosine, 0.0))


def _units(rows: Any) -> list[list[float]]:
    out = []
    for row in rows:
        values = [float(x) for x in row]
        norm = sum(x * x for x in values) ** 0.5 or 1.0
        out.append([x / norm for x in values])
    return out


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.retrieval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--modules", type=int, default=80)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    found = measure(args.seed, args.modules)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    print(f"{found['cases']} steps, each a traceback through one of {found['modules']} modules of this repository; "
          f"the best-ranked of ten candidates is the right module in {found['best_is_right']:.1%}")
    print(f"{'min_score':>9} {'right one back (holds it)':>25} {'a piece back (holds none)':>26}")
    for threshold, row in found["thresholds"].items():
        print(f"{threshold:>9} {row['positive_found']:>25.1%} {row['negative_brought_back']:>26.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
