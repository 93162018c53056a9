"""Training examples from the gateway's own traffic: shadow-pair labels, with their prompts from the label
itself or from a request log (both keep prompt text only with AGENT_GATEWAY_REQUEST_LOG_PROMPTS=1)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.classifier.training import Example
from gateway.features import extract

GROUP = "labels"  # the group of label rows in a grouped cross-validation
NO_PROMPT = "no prompt text"


@dataclass(slots=True)
class LabelRows:
    """The examples found in a labels file and the rows skipped, by reason."""

    examples: list[Example] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return f"{len(self.examples)} label rows used, skipped: {skipped}"


def _jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield number, row


def request_bodies(path: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """request_id -> (endpoint, body) of the request-log lines that kept their body (the prompts opt-in)."""
    found = {}
    for _, row in _jsonl(path):
        body, request_id = row.get("body"), row.get("request_id")
        if isinstance(body, dict) and isinstance(request_id, str):
            found[request_id] = (str(row.get("endpoint") or "chat"), body)
    return found


def label_examples(path: str, weight: float = 1.0, request_log: str | None = None) -> LabelRows:
    """The labels JSONL (`agent-gateway shadow labels`) as training examples, each weighing `weight` CSV rows.

    A label's quality pair is its `q_strong`, `q_weak`; its prompt is its own `body`, else the body the
    request log kept for the same request id. Rows with neither are skipped and counted.
    """
    if not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"--labels-weight must be a positive number, got {weight}")
    bodies = request_bodies(request_log) if request_log else {}
    out = LabelRows()
    for number, row in _jsonl(path):
        q_strong, q_weak = (_quality(path, number, row, name) for name in ("q_strong", "q_weak"))
        body, endpoint = row.get("body"), str(row.get("endpoint") or "chat")
        if not isinstance(body, dict):
            endpoint, body = bodies.get(str(row.get("request_id")), (endpoint, None))
        if not isinstance(body, dict) or not (body.get("messages") or body.get("prompt")):
            out.skipped[NO_PROMPT] += 1
            continue
        features = extract(body, endpoint)
        out.examples.append(Example(features, q_strong, q_weak, GROUP, _prompt_chars(body), weight))
    return out


def _quality(path: str, number: int, row: Mapping[str, Any], name: str) -> float:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{path}:{number}: field {name!r}: value {value!r} is not a number")
    return float(value)


def _prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of text the request carries, as the CSV loader counts them for the length baseline."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    messages = body.get("messages") or []
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
