"""Comparison of a shadow pair (primary vs shadow response) and the summary `shadow report` prints."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.rollout.samples import PairOutcome
from gateway.rollout.stats import median_interval, wilson, win_share

SIMILARITY_MAX_TOKENS = 4096  # token-set Jaccard is linear; the cap bounds it on giant answers
_WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True, slots=True)
class Capture:
    """One side of a pair as the shadow module saw it: a JSON body, or the parsed SSE data objects."""

    status: int
    total_ms: float
    ttft_ms: float | None = None
    body: Mapping[str, Any] | None = None
    chunks: Sequence[Mapping[str, Any]] | None = None
    error: str | None = None  # transport failure or timeout, when there is no usable response
    deployment: str | None = None  # the deployment that answered (the primary's, after any failover)


@dataclass(slots=True)
class Completion:
    """The parts of a chat/completions answer the comparison reads, assembled from a body or a stream."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _merge_tool_deltas(calls: dict[int, dict[str, Any]], deltas: Sequence[Mapping[str, Any]]) -> None:
    for delta in deltas:
        slot = calls.setdefault(int(delta.get("index", len(calls))), {"name": "", "arguments": ""})
        function = delta.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""


def assemble(capture: Capture) -> Completion:
    """Text, finish reason, tokens and tool calls of the first choice, streamed or not."""
    out = Completion()
    if capture.body is not None:
        choice = (capture.body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        out.text = message.get("content") or choice.get("text") or ""
        out.finish_reason = choice.get("finish_reason")
        out.tool_calls = [
            {
                "name": (c.get("function") or {}).get("name", ""),
                "arguments": (c.get("function") or {}).get("arguments", ""),
            }
            for c in message.get("tool_calls") or []
        ]
        out.completion_tokens = (capture.body.get("usage") or {}).get("completion_tokens")
        return out
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in capture.chunks or ():
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            parts.append(delta.get("content") or choice.get("text") or "")
            _merge_tool_deltas(calls, delta.get("tool_calls") or [])
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if chunk.get("usage"):
            out.completion_tokens = chunk["usage"].get("completion_tokens")
    out.text = "".join(parts)
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


def _json_valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _tools_valid(calls: list[dict[str, Any]], offered: set[str]) -> bool:
    """Every call names an offered tool and its arguments parse as a JSON object."""
    for call in calls:
        if offered and call["name"] not in offered:
            return False
        try:
            if not isinstance(json.loads(call["arguments"] or "{}"), dict):
                return False
        except ValueError:
            return False
    return True


def similarity(a: str, b: str) -> float:
    """Token-set Jaccard of two texts in [0, 1]; two empty texts are identical."""
    left = set(_WORD.findall(a.lower())[:SIMILARITY_MAX_TOKENS])
    right = set(_WORD.findall(b.lower())[:SIMILARITY_MAX_TOKENS])
    if not left and not right:
        return 1.0
    return len(left & right) / len(left | right)


def _side(capture: Capture, done: Completion, wants_json: bool, offered: set[str]) -> dict[str, Any]:
    ok = capture.error is None and 200 <= capture.status < 300
    return {
        "ok": ok,
        "deployment": capture.deployment,
        "status": capture.status,
        "error": capture.error,
        "ttft_ms": capture.ttft_ms,
        "total_ms": capture.total_ms,
        "completion_tokens": done.completion_tokens,
        "finish_reason": done.finish_reason,
        "json_valid": (ok and _json_valid(done.text)) if wants_json else None,
        "tool_calls": len(done.tool_calls),
        "tool_calls_valid": (ok and _tools_valid(done.tool_calls, offered)) if done.tool_calls else None,
    }


def _offered_tools(request: Mapping[str, Any]) -> set[str]:
    return {
        (t.get("function") or {}).get("name", "") for t in request.get("tools") or [] if isinstance(t, dict)
    }


def compare(
    request: Mapping[str, Any], primary: Capture, shadow: Capture, shadow_cap_tokens: int | None = None
) -> dict[str, Any]:
    """A JSON-serialisable record of one pair; `outcome` is the shadow's win/loss/tie against the primary.

    `shadow_cap_tokens` is the max_tokens the shadow ran under: a shadow it cut short (finish_reason
    `length` below the client's own cap) makes the pair unusable, not a loss of the candidate.
    """
    fmt = (request.get("response_format") or {}).get("type")
    wants_json = fmt in ("json_object", "json_schema")
    offered = _offered_tools(request)
    p_done, s_done = assemble(primary), assemble(shadow)
    record: dict[str, Any] = {
        "model": request.get("model"),
        "stream": bool(request.get("stream")),
        "json_requested": wants_json,
        "tools_offered": len(offered),
        "primary": _side(primary, p_done, wants_json, offered),
        "shadow": _side(shadow, s_done, wants_json, offered),
    }
    both_ok = record["primary"]["ok"] and record["shadow"]["ok"]
    record["exact_match"] = (
        (p_done.text == s_done.text) if both_ok and request.get("temperature") == 0 else None
    )
    record["similarity"] = round(similarity(p_done.text, s_done.text), 4) if both_ok else None
    record["finish_reason_match"] = (p_done.finish_reason == s_done.finish_reason) if both_ok else None
    record["shadow_truncated"] = s_done.finish_reason == "length" and _binding(request, shadow_cap_tokens)
    record["outcome"] = outcome(record).value
    return record


def _binding(request: Mapping[str, Any], cap_tokens: int | None) -> bool:
    """Whether the shadow's cap was lower than what the primary could generate (the client's own cap)."""
    if cap_tokens is None:
        return False
    own = request.get("max_completion_tokens", request.get("max_tokens"))
    return not isinstance(own, int) or own > cap_tokens


def outcome(record: Mapping[str, Any]) -> PairOutcome:
    """The paired verdict from objective checks only: failure, then JSON validity, then tool-call validity."""
    judged = record.get("judge")
    if isinstance(judged, str) and judged in PairOutcome._value2member_map_:
        return PairOutcome(judged)
    if record.get("shadow_truncated"):
        return PairOutcome.UNUSABLE
    primary, shadow = record["primary"], record["shadow"]
    for check in ("ok", "json_valid", "tool_calls_valid"):
        p, s = primary.get(check), shadow.get(check)
        if p is None or s is None or p == s:
            continue
        return PairOutcome.WIN if s else PairOutcome.LOSS
    return PairOutcome.TIE


def _get(record: Mapping[str, Any], path: str) -> Any:
    value: Any = record
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _rate(records: Sequence[Mapping[str, Any]], path: str) -> dict[str, Any]:
    """Share of records where the check held, among those where it applied, with a 95% Wilson interval."""
    seen = [v for v in (_get(r, path) for r in records) if v is not None]
    k, n = sum(1 for v in seen if v), len(seen)
    lower, upper = wilson(k, n, 0.025)
    return {"k": k, "n": n, "rate": k / n if n else None, "interval": [lower, upper] if n else None}


def _median(values: Sequence[float]) -> dict[str, Any]:
    found = median_interval(values, 0.025)
    if found is None:
        return {"n": 0, "median": None, "interval": None}
    median, lower, upper = found
    return {"n": len(values), "median": median, "interval": [lower, upper]}


def _numbers(records: Sequence[Mapping[str, Any]], path: str) -> list[float]:
    return [float(v) for v in (_get(r, path) for r in records) if isinstance(v, int | float)]


def _paired(records: Sequence[Mapping[str, Any]], path: str, ratio: bool = False) -> list[float]:
    """Per-pair shadow minus primary (or shadow / primary) where both sides have the figure."""
    out: list[float] = []
    for r in records:
        p, s = _get(r, f"primary.{path}"), _get(r, f"shadow.{path}")
        if isinstance(p, int | float) and isinstance(s, int | float) and (not ratio or p > 0):
            out.append(s / p if ratio else s - p)
    return out


RATES = (
    "primary.ok",
    "shadow.ok",
    "exact_match",
    "finish_reason_match",
    "primary.json_valid",
    "shadow.json_valid",
    "primary.tool_calls_valid",
    "shadow.tool_calls_valid",
)


def summarize(records: Sequence[Mapping[str, Any]], margin: float = 0.05) -> dict[str, Any]:
    """Figures with 95% intervals: rates (Wilson), medians (order statistics), the paired win-share test."""
    counts = {o.value: sum(1 for r in records if r.get("outcome") == o.value) for o in PairOutcome}
    verdict = win_share("win_share", counts["win"], counts["loss"], margin, 0.025)
    return {
        "pairs": len(records),
        "rates": {path: _rate(records, path) for path in RATES},
        "medians": {
            "similarity": _median(_numbers(records, "similarity")),
            "primary.ttft_ms": _median(_numbers(records, "primary.ttft_ms")),
            "shadow.ttft_ms": _median(_numbers(records, "shadow.ttft_ms")),
            "ttft_ms shadow-primary": _median(_paired(records, "ttft_ms")),
            "total_ms shadow-primary": _median(_paired(records, "total_ms")),
            "completion_tokens shadow/primary": _median(_paired(records, "completion_tokens", ratio=True)),
        },
        "outcomes": counts,
        "win_share": verdict.to_dict(),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_report(summary: Mapping[str, Any]) -> str:
    """The human-readable table `agent-gateway shadow report` prints."""
    lines = [f"shadow pairs: {summary['pairs']}", "", f"{'rate':34} {'k/n':>11} {'rate':>7}  95% interval"]
    for name, fig in summary["rates"].items():
        if fig["n"]:
            lo, hi = fig["interval"]
            lines.append(f"{name:34} {fig['k']:>5}/{fig['n']:<5} {fig['rate']:>7.3f}  [{lo:.3f}, {hi:.3f}]")
    lines += ["", f"{'median':34} {'n':>11} {'median':>7}  95% interval"]
    for name, fig in summary["medians"].items():
        if fig["n"]:
            lo, hi = fig["interval"]
            lines.append(f"{name:34} {fig['n']:>11} {_fmt(fig['median']):>7}  [{_fmt(lo)}, {_fmt(hi)}]")
    o, w = summary["outcomes"], summary["win_share"]
    lo, hi = w["interval"]
    lines += [
        "",
        f"outcomes: {o['win']} wins, {o['loss']} losses, {o['tie']} ties"
        f" ({o['unusable']} unusable: the shadow cut short by its token cap)",
        f"win share {_fmt(w['estimate'])} [{_fmt(lo)}, {_fmt(hi)}]: {w['status']} ({w['detail']})",
    ]
    return "\n".join(lines)
