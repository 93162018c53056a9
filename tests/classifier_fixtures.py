"""Small synthetic labelled-prompt data for the classifier tests (hard prompts are longer and mathier)."""

from __future__ import annotations

import csv
import gzip
import json
import random
from pathlib import Path

EASY = ["capital", "colour", "name", "weather", "hello", "thanks", "recipe", "song", "city", "dog"]
HARD = [
    "integral",
    "eigenvalue",
    "theorem",
    "prove",
    "derivative",
    "lemma",
    "asymptotic",
    "∫ x² dx",
    "Σ",
    "matrix",
]
CATEGORIES = ["algebra", "trivia", "physics", "chat"]


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Rows of the standard CSV format; q_strong > q_weak mostly where the prompt is hard."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hard = rng.random() < 0.35
        words = rng.choices(HARD if hard else EASY, k=rng.randint(4, 30 if hard else 10))
        filler = rng.choices(EASY + HARD, k=rng.randint(0, 5))
        prompt = " ".join(words + filler) + ("?" if rng.random() < 0.5 else ".\n\n  Answer:")
        q_weak = 0.0 if hard and rng.random() < 0.8 else 1.0
        q_strong = 1.0 if rng.random() < 0.9 else 0.0
        rows.append(
            {
                "item_id": f"item{i}",
                "category": CATEGORIES[i % len(CATEGORIES)],
                "prompt": prompt,
                "q_strong": str(q_strong),
                "q_weak": str(q_weak),
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8", newline="") as handle:  # type: ignore[operator]
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def as_messages(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same rows with a `messages` JSON column in place of `prompt`."""
    out = []
    for row in rows:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}]
        out.append({k: v for k, v in row.items() if k != "prompt"} | {"messages": json.dumps(chat)})
    return out
