"""What `agent-gateway eval` prints: per policy pass rate, steps, cost, cost per solved case and latencies,
side by side, and each policy against the first with 95% intervals on the differences."""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.rollout.stats import difference_interval, wilson

BOOTSTRAP_SAMPLES = 2000
TAIL = 0.025  # each tail of a 95% interval


@dataclass(slots=True)
class Result:
    """One agent run of one case under one policy."""

    policy: str
    case: str
    repeat: int
    tags: tuple[str, ...]
    passed: bool
    reason: str
    steps: int
    cost_usd: float | None  # the session's spend as the gateway recorded it (None: not recorded)
    session_s: float
    step_ms: list[float] = field(default_factory=list)
    session_id: str = ""
    outcome_recorded: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """One policy's figures (costs over the runs whose spend the gateway recorded)."""
    n, k = len(results), sum(r.passed for r in results)
    costs = [r.cost_usd for r in results if r.cost_usd is not None]
    solved_cost = sum(costs) / k if k and costs else None
    low, high = wilson(k, n, TAIL)
    tags = sorted({t for r in results for t in r.tags})
    return {
        "runs": n, "passed": k, "pass_rate": k / n if n else None, "pass_rate_interval": [low, high],
        "mean_steps": statistics.fmean(r.steps for r in results) if n else None,
        "mean_cost_usd": statistics.fmean(costs) if costs else None, "cost_per_solved_usd": solved_cost,
        "p50_step_ms": _median([ms for r in results for ms in r.step_ms]),
        "p50_session_s": _median([r.session_s for r in results]),
        "outcomes_recorded": sum(r.outcome_recorded for r in results),
        "by_tag": {t: _rate([r for r in results if t in r.tags]) for t in tags},
    }  # fmt: skip


def _rate(results: Sequence[Result]) -> dict[str, Any]:
    k = sum(r.passed for r in results)
    return {"runs": len(results), "passed": k, "pass_rate": k / len(results) if results else None}


def difference(base: Sequence[Result], other: Sequence[Result], seed: int = 0) -> dict[str, Any]:
    """`other` against `base`: the pass rates' difference with Newcombe's interval, and the ratio of cost per
    solved case with a bootstrap interval over the cases (runs paired by case and repeat)."""
    n0, k0, n1, k1 = len(base), sum(r.passed for r in base), len(other), sum(r.passed for r in other)
    out: dict[str, Any] = {"pass_rate_difference": None, "pass_rate_interval": None,
                           "cost_per_solved_ratio": None, "cost_per_solved_interval": None}
    if n0 and n1:
        out["pass_rate_difference"] = k1 / n1 - k0 / n0
        out["pass_rate_interval"] = list(difference_interval(k1, n1, k0, n0, TAIL))
    pairs = _pairs(base, other)
    ratio = _ratio(pairs)
    if ratio is not None:
        out["cost_per_solved_ratio"] = ratio
        out["cost_per_solved_interval"] = _bootstrap(pairs, seed)
    return out


Pair = tuple[float, bool, float, bool]  # base cost, base passed, other cost, other passed


def _pairs(base: Sequence[Result], other: Sequence[Result]) -> list[Pair]:
    mine = {(r.case, r.repeat): r for r in other}
    out = []
    for r in base:
        o = mine.get((r.case, r.repeat))
        if o is not None and r.cost_usd is not None and o.cost_usd is not None:
            out.append((r.cost_usd, r.passed, o.cost_usd, o.passed))
    return out


def _ratio(pairs: Sequence[Pair]) -> float | None:
    base_solved, other_solved = sum(p[1] for p in pairs), sum(p[3] for p in pairs)
    base_cost = sum(p[0] for p in pairs)
    if not base_solved or not other_solved or not base_cost:
        return None
    return (sum(p[2] for p in pairs) / other_solved) / (base_cost / base_solved)


def _bootstrap(pairs: Sequence[Pair], seed: int) -> list[float] | None:
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP_SAMPLES):
        found = _ratio([pairs[rng.randrange(len(pairs))] for _ in pairs])
        if found is not None:
            ratios.append(found)
    if len(ratios) < BOOTSTRAP_SAMPLES // 2:
        return None  # most resamples solved nothing on one side: no interval worth printing
    ratios.sort()
    return [ratios[int(TAIL * len(ratios))], ratios[int((1 - TAIL) * len(ratios)) - 1]]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(policies: Sequence[str], summaries: Mapping[str, dict[str, Any]],
          differences: Mapping[str, dict[str, Any]]) -> str:
    """The side-by-side table, then each policy against the first."""
    rows: list[tuple[str, list[str]]] = []
    for label, key, fmt in (("pass rate", "pass_rate", _pct), ("mean steps", "mean_steps", _num),
                            ("mean cost", "mean_cost_usd", _usd), ("cost per solved case", "cost_per_solved_usd", _usd),
                            ("p50 step latency ms", "p50_step_ms", lambda v: _num(v, 0)),
                            ("p50 session time s", "p50_session_s", lambda v: _num(v, 2))):
        rows.append((label, [fmt(summaries[p][key]) for p in policies]))
    rows.insert(1, ("  95% interval", [_interval(summaries[p]["pass_rate_interval"], _pct) for p in policies]))
    rows.insert(0, ("runs (passed)", [f"{summaries[p]['runs']} ({summaries[p]['passed']})" for p in policies]))
    for tag in sorted({t for p in policies for t in summaries[p]["by_tag"]}):
        rows.append((f"pass rate [{tag}]", [_tag(summaries[p]["by_tag"].get(tag)) for p in policies]))
    width = max(14, *(len(p) for p in policies))
    lines = [f"{'':24}" + "".join(f"{p[:width]:>{width + 2}}" for p in policies)]
    lines += [f"{label:24}" + "".join(f"{cell:>{width + 2}}" for cell in cells) for label, cells in rows]
    for policy, diff in differences.items():
        lines.append("")
        lines.append(f"{policy} vs {policies[0]}: pass rate {_signed(diff['pass_rate_difference'])} "
                     f"(95% CI {_interval(diff['pass_rate_interval'], _signed)}, Newcombe); cost per solved case "
                     f"x{_num(diff['cost_per_solved_ratio'], 2)} (95% CI "
                     f"{_interval(diff['cost_per_solved_interval'], lambda v: _num(v, 2))}, bootstrap over cases)")
    return "\n".join(lines)


def _tag(found: dict[str, Any] | None) -> str:
    return "-" if not found else f"{_pct(found['pass_rate'])} of {found['runs']}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f} pts"


def _interval(bounds: Sequence[float] | None, fmt: Any) -> str:
    return "-" if not bounds else f"[{fmt(bounds[0])}, {fmt(bounds[1])}]"
