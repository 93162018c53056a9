"""The RouteLLM procedure (Ong et al. 2024): quality against HQ share as a threshold sweeps the scores' deciles,
APGR and CPT(50%/80%), beside random and prompt-length routers; per dataset and on a mixed stream."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

CURVE_POINTS = 10  # RouteLLM: thresholds at the score's deciles
RANDOM_SEEDS = 10


class Example(Protocol):
    """What the procedure reads of a labelled prompt (training.Example has it)."""

    @property
    def q_strong(self) -> float: ...
    @property
    def q_weak(self) -> float: ...
    @property
    def prompt_chars(self) -> int: ...
    @property
    def dataset(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Curve:
    """Quality against HQ share, one point per threshold, sorted by share."""

    hq_share: FloatArray
    quality: FloatArray
    thresholds: FloatArray


def routing_curve(
    scores: FloatArray, q_strong: FloatArray, q_weak: FloatArray, points: int = CURVE_POINTS
) -> Curve:
    """RouteLLM's sweep: thresholds at the score quantiles; route to HQ where score >= threshold."""
    thresholds = np.quantile(scores, np.linspace(0.0, 1.0, points + 1))
    rows = []
    for i, threshold in enumerate(thresholds):
        # the last threshold uses '>' so the sweep always ends at 0% HQ
        to_hq = scores >= threshold if i < points else scores > threshold
        rows.append((float(to_hq.mean()), float(np.where(to_hq, q_strong, q_weak).mean()), float(threshold)))
    rows.sort()
    table = np.array(rows)
    return Curve(table[:, 0], table[:, 1], table[:, 2])


@dataclass(frozen=True, slots=True)
class Summary:
    """RouteLLM figures: average performance gap recovered, and HQ share needed for 50% / 80% of the gap."""

    apgr: float
    cpt50: float
    cpt80: float


def summarize(curve: Curve, strong: float, weak: float) -> Summary:
    """APGR = area between the curve and the weak line over the strong-weak gap; CPT by interpolation."""
    span = curve.hq_share[-1] - curve.hq_share[0]
    gap = strong - weak
    if span <= 0 or gap == 0:
        return Summary(math.nan, math.nan, math.nan)
    area = float(np.trapezoid(curve.quality, curve.hq_share))
    apgr = (area - weak * span) / (gap * span)
    # np.interp as RouteLLM does: quality treated as increasing in HQ share
    cpt = [float(np.interp(weak + x * gap, curve.quality, curve.hq_share)) for x in (0.5, 0.8)]
    return Summary(apgr, cpt[0], cpt[1])


def compare_routers(
    scores: FloatArray, examples: Sequence[Example], seed: int = 0
) -> dict[str, tuple[Summary, Curve]]:
    """The classifier beside a random router (mean of several seeds) and a prompt-length router."""
    q_strong = np.array([e.q_strong for e in examples])
    q_weak = np.array([e.q_weak for e in examples])
    strong, weak = float(q_strong.mean()), float(q_weak.mean())
    out: dict[str, tuple[Summary, Curve]] = {}
    curve = routing_curve(scores, q_strong, q_weak)
    out["classifier"] = (summarize(curve, strong, weak), curve)
    rng = np.random.default_rng(seed)
    randoms = [routing_curve(rng.random(len(examples)), q_strong, q_weak) for _ in range(RANDOM_SEEDS)]
    figures = np.array([astuple(summarize(c, strong, weak)) for c in randoms])
    out["random"] = (Summary(*figures.mean(axis=0).tolist()), randoms[0])
    lengths = np.array([e.prompt_chars for e in examples], dtype=np.float64)
    curve = routing_curve(lengths, q_strong, q_weak)
    out["prompt length"] = (summarize(curve, strong, weak), curve)
    return out


def astuple(summary: Summary) -> tuple[float, float, float]:
    return (summary.apgr, summary.cpt50, summary.cpt80)


def report(results: dict[str, tuple[Summary, Curve]], strong: float, weak: float) -> list[str]:
    """The figures as aligned text lines."""
    lines = [
        f"HQ-only quality {strong:.4f}, fast-only quality {weak:.4f} (gap {strong - weak:.4f})",
        f"{'router':<16}{'APGR':>8}{'CPT(50%)':>11}{'CPT(80%)':>11}",
    ]
    for name, (summary, _) in results.items():
        lines.append(f"{name:<16}{summary.apgr:>8.3f}{summary.cpt50:>10.1%}{summary.cpt80:>11.1%}")
    return lines


def plot(results: dict[str, tuple[Summary, Curve]], strong: float, weak: float, path: str | Path) -> None:
    """Quality against HQ share for each router, with the HQ-only and fast-only lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (summary, curve) in results.items():
        ax.plot(curve.hq_share * 100, curve.quality, marker=".", label=f"{name} (APGR {summary.apgr:.3f})")
    ax.axhline(strong, color="red", linestyle="--", label="HQ only")
    ax.axhline(weak, color="grey", linestyle="--", label="fast only")
    ax.set_xlabel("calls routed to HQ (%)")
    ax.set_ylabel("quality")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


MIXED_ROWS_PER_DATASET = 500  # the mixed stream takes at most this many rows of each dataset
MIXED = "mixed stream"
ALL_ROWS = "all rows"
# The bar for a held-out dataset: at least prompt length, and random plus this much
MARGIN_OVER_RANDOM = 0.03

Results = dict[str, tuple[Summary, Curve]]


def mixed_stream(examples: Sequence[Example], per_dataset: int = MIXED_ROWS_PER_DATASET, seed: int = 0) -> list[int]:
    """Indices of one stream of every dataset: at most per_dataset rows of each (drawn at random), so that
    no dataset's size decides the figure."""
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for dataset in sorted({e.dataset for e in examples}):
        rows = [i for i, e in enumerate(examples) if e.dataset == dataset]
        chosen.extend(sorted(rng.choice(rows, size=min(per_dataset, len(rows)), replace=False).tolist()))
    return chosen


def by_dataset(scores: FloatArray, examples: Sequence[Example]) -> dict[str, tuple[int, Results]]:
    """The routers compared on each dataset, on the mixed stream and on all rows: name -> (rows, results)."""
    subsets = {d: [i for i, e in enumerate(examples) if e.dataset == d] for d in sorted({e.dataset for e in examples})}
    subsets[MIXED] = mixed_stream(examples)
    subsets[ALL_ROWS] = list(range(len(examples)))
    return {
        name: (len(rows), compare_routers(scores[rows], [examples[i] for i in rows])) for name, rows in subsets.items()
    }


def dataset_report(tables: dict[str, tuple[int, Results]]) -> list[str]:
    """One line per dataset: the classifier's APGR beside random and prompt length, its CPTs, and whether
    it clears the bar (at least prompt length and random + MARGIN_OVER_RANDOM)."""
    header = f"{'rows':>7}{'APGR':>8}{'random':>8}{'length':>8}{'CPT(50%)':>10}{'CPT(80%)':>10}  bar"
    lines = [f"{'held-out dataset':<30}{header}"]
    for name, (rows, results) in tables.items():
        ours, rand, length = (results[k][0] for k in ("classifier", "random", "prompt length"))
        clears = ours.apgr >= length.apgr and ours.apgr >= rand.apgr + MARGIN_OVER_RANDOM
        lines.append(
            f"{name:<30}{rows:>7}{ours.apgr:>8.3f}{rand.apgr:>8.3f}{length.apgr:>8.3f}"
            f"{ours.cpt50:>10.1%}{ours.cpt80:>10.1%}  {'yes' if clears else 'no'}"
        )
    return lines
