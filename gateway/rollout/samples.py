"""Per-request samples of the candidate and control cohorts, aggregated as flat counters in bounded memory."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

# Latency histograms are log-spaced at 10% per bin from 1 ms to ~70 min: a p95 read from them is within
# 10% of the exact one, and a cohort's whole state is a few hundred integers whatever the traffic.
BIN_RATIO = 1.1
BIN_COUNT = 160
# TTFT depends on prompt length far more than on the deployment: compare like with like (tokens).
PROMPT_STRATA_TOKENS = (512, 2048, 8192)


class Cohort(StrEnum):
    """Whose samples a counter holds."""

    CANDIDATE = "candidate"  # requests served by the candidate target
    CONTROL = "control"  # requests from the bucket range [w, 2w), served by stable, compared against


class PairOutcome(StrEnum):
    """How the shadow (candidate) answer fared against the primary (stable) one for the same request."""

    WIN = "win"  # the candidate's answer is better
    LOSS = "loss"  # the candidate's answer is worse
    TIE = "tie"  # no difference the comparison can tell
    UNUSABLE = "unusable"  # no fair comparison: the shadow was cut short by its own token cap


@dataclass(frozen=True, slots=True)
class Sample:
    """One served request's outcome, as the request path records it after the response ends."""

    error: bool  # the gateway's fault or the deployment's (5xx, timeout, broken stream), never a client 4xx
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # (total - ttft) / (completion_tokens - 1), when at least 2 tokens


def latency_bin(ms: float) -> int:
    """The histogram bin of a latency; bin i holds (BIN_RATIO**i, BIN_RATIO**(i+1)] ms, bin 0 all below."""
    if ms <= 1.0:
        return 0
    return min(BIN_COUNT - 1, int(math.log(ms) / math.log(BIN_RATIO)))


def bin_upper_ms(index: int) -> float:
    return float(BIN_RATIO ** (index + 1))


def prompt_stratum(prompt_tokens: int) -> int:
    return sum(1 for edge in PROMPT_STRATA_TOKENS if prompt_tokens >= edge)


def counter_fields(cohort: Cohort, sample: Sample) -> list[str]:
    """The counters one sample increments by 1: the request path HINCRBYs these (or adds to a Counter)."""
    c = cohort.value
    fields = [f"{c}.requests"]
    if sample.error:
        fields.append(f"{c}.errors")
    if sample.ttft_ms is not None:
        fields.append(f"{c}.ttft.{prompt_stratum(sample.prompt_tokens)}.{latency_bin(sample.ttft_ms)}")
    if sample.tpot_ms is not None:
        fields.append(f"{c}.tpot.{latency_bin(sample.tpot_ms)}")
    return fields


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One agent step's process facts, counted once the trajectory flusher has digested the step."""

    tool_results: int = 0  # tool outputs the agent sent back with this step
    tool_errors: int = 0  # of which were errors
    tool_step: bool = False  # the model asked for a tool call
    rework: bool = False  # it asked for a tool call the session had already made


PROCESS_FIELDS = ("tool_results", "tool_errors", "tool_steps", "rework")


def process_fields(cohort: Cohort, sample: ProcessSample) -> dict[str, int]:
    """The counters one step adds to (tool-call error rate: tool_errors / tool_results; rework rate:
    rework / tool_steps)."""
    c = cohort.value
    counts = {f"{c}.tool_results": sample.tool_results, f"{c}.tool_errors": sample.tool_errors,
              f"{c}.tool_steps": int(sample.tool_step), f"{c}.rework": int(sample.rework)}
    return {name: n for name, n in counts.items() if n}


@dataclass(frozen=True, slots=True)
class OutcomeSample:
    """One agent session's reported outcome and its spend when reported: counted once per session (a report
    that replaces an earlier one takes the earlier one's counts back)."""

    success: bool
    cost_usd: float


OUTCOME_FIELDS = ("outcomes", "successes", "cost_nusd", "cost_sq_uusd2", "success_cost_nusd")
NANO_USD = 1e9  # cost sums are kept in integer nano-USD (the store's counters are integers)
MICRO_USD = 1e6  # squared costs in (micro-USD)^2: nano-USD squared overflows 64 bits at a few USD a session


def outcome_fields(cohort: Cohort, sample: OutcomeSample, sign: int = 1) -> dict[str, int]:
    """The counters one session's outcome adds (sign 1) or takes back (sign -1): sessions, successes, and the
    spend sums the cost-per-success test reads (sum of cost, of cost squared, of cost over successes)."""
    c, cost = cohort.value, sample.cost_usd
    counts = {f"{c}.outcomes": 1, f"{c}.successes": int(sample.success), f"{c}.cost_nusd": round(cost * NANO_USD),
              f"{c}.cost_sq_uusd2": round((cost * MICRO_USD) ** 2),
              f"{c}.success_cost_nusd": round(cost * NANO_USD) if sample.success else 0}
    return {name: sign * n for name, n in counts.items() if n}


def pair_field(outcome: PairOutcome) -> str:
    return f"shadow.{outcome.value}"


@dataclass(slots=True)
class CohortCounts:
    requests: int = 0
    errors: int = 0
    ttft: dict[int, Counter[int]] = field(default_factory=dict)  # prompt stratum -> latency bin -> count
    tpot: Counter[int] = field(default_factory=Counter)
    tool_results: int = 0
    tool_errors: int = 0
    tool_steps: int = 0
    rework: int = 0
    outcomes: int = 0  # sessions with a reported outcome
    successes: int = 0
    cost_nusd: int = 0  # their spend
    cost_sq_uusd2: int = 0
    success_cost_nusd: int = 0


@dataclass(slots=True)
class Observations:
    """Everything step() looks at for one rollout window, rebuilt from counters on every tick."""

    candidate: CohortCounts = field(default_factory=CohortCounts)
    control: CohortCounts = field(default_factory=CohortCounts)
    pairs: Counter[PairOutcome] = field(default_factory=Counter)

    def cohort(self, cohort: Cohort) -> CohortCounts:
        return self.candidate if cohort is Cohort.CANDIDATE else self.control

    def add(self, fieldname: str, count: int = 1) -> None:
        """Apply one counter; unknown names are ignored so an older ticker tolerates newer writers."""
        parts = fieldname.split(".")
        if parts[0] == "shadow" and len(parts) == 2 and parts[1] in PairOutcome._value2member_map_:
            self.pairs[PairOutcome(parts[1])] += count
            return
        if parts[0] not in Cohort._value2member_map_:
            return
        counts = self.cohort(Cohort(parts[0]))
        if parts[1:] == ["requests"]:
            counts.requests += count
        elif parts[1:] == ["errors"]:
            counts.errors += count
        elif len(parts) == 2 and (parts[1] in PROCESS_FIELDS or parts[1] in OUTCOME_FIELDS):
            setattr(counts, parts[1], getattr(counts, parts[1]) + count)
        elif parts[1] == "ttft" and len(parts) == 4:
            counts.ttft.setdefault(int(parts[2]), Counter())[int(parts[3])] += count
        elif parts[1] == "tpot" and len(parts) == 3:
            counts.tpot[int(parts[2])] += count

    @classmethod
    def from_counts(cls, counts: Mapping[str, int | str | bytes]) -> Observations:
        """Rebuild from a flat counter mapping (a Redis HGETALL reply or a Counter)."""
        obs = cls()
        for name, value in counts.items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            obs.add(key, int(value))
        return obs


def record(counts: Counter[str], cohort: Cohort, sample: Sample) -> None:
    """The in-memory twin of the request path's HINCRBYs."""
    for name in counter_fields(cohort, sample):
        counts[name] += 1
