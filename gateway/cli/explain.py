"""`policy explain` offline: one request file through the pure decision with assumed load, no deployment called."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from gateway import openai
from gateway.decision.admission import (
    ANONYMOUS,
    Admission,
    SessionState,
    TenantSnapshot,
    WindowUsage,
    costs_of,
    judge,
    steered,
    window_bucket,
)
from gateway.decision.explain import explanation
from gateway.decision.routing import Context, DeploymentLoad, decide, needs_complexity
from gateway.features import extract
from gateway.policy import model as policy_module
from gateway.policy.tenancy import Window


class ExplainInputError(ValueError):
    """A bad --request, --header or --load argument."""


def offline(
    policy_path: str, request_path: str, endpoint: str, headers: Sequence[str], tenant: str | None,
    loads: Sequence[str], spent: Sequence[str] = (), session: Sequence[str] = (),
) -> dict[str, Any]:
    policy = policy_module.load(policy_path)
    try:
        raw = Path(request_path).read_bytes()
    except OSError as exc:
        raise ExplainInputError(f"cannot read: {exc.strerror}") from exc
    body = openai.decode(raw)
    openai.check(body, endpoint)
    features = extract(body, endpoint)
    complexity, top = None, []
    if needs_complexity(policy):
        from gateway.classifier.scoring import Classifier

        classifier = policy.classifier.model if policy.classifier is not None else Classifier.default()
        complexity = classifier.score(features)
        top = classifier.explain(features)
    given = _headers(headers)
    choices = openai.choices_of(body, endpoint)
    verdict, state = _admission(policy, features, len(raw), given, tenant, spent, session, choices)
    ctx = Context(headers=given, tenant=tenant, complexity=complexity,
                  load=_loads(policy.deployments, loads), admission=verdict, session=state)
    decision = decide(policy, features, ctx, explain=True)

    report = explanation(decision, features, ctx)
    report["top_features"] = [[name, round(weight, 4)] for name, weight in top]
    return report


def _headers(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise ExplainInputError(f"--header {item!r}: expected NAME:VALUE")
        out[name.strip().lower()] = value.strip()
    return out


def _admission(
    policy: policy_module.Policy, features: Any, body_bytes: int, headers: dict[str, str], tenant: str | None,
    spent: Sequence[str], session: Sequence[str], choices: int = 1,
) -> tuple[Admission | None, SessionState | None]:
    """The budget verdict with assumed spend (`--spent-usd day=45`) and session (`--session pinned=hq`)."""
    if not (steered(policy, headers) or spent or session):
        return None, None
    now_s = time.time()
    windows = {}
    for item in spent:
        window, _, usd = item.partition("=")
        try:
            windows[Window(window)] = WindowUsage(Window(window), spend_usd=float(usd),
                                                  ends_at_s=window_bucket(Window(window), now_s)[1])
        except ValueError as exc:
            raise ExplainInputError(f"--spent-usd {item!r}: expected WINDOW=USD, WINDOW one of "
                                    f"{', '.join(Window)}") from exc
    snapshot = TenantSnapshot(tenant or ANONYMOUS, now_s, windows)
    state = _session(session) if session else None
    costs = costs_of(policy, features, body_bytes, choices)
    return judge(policy, costs, headers, snapshot, state), state


def _session(items: Sequence[str]) -> SessionState:
    values: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            values[name] = value if name == "pinned" else float(value)
            if name not in ("pinned", "steps_per_min", "cost_usd"):
                raise ValueError(name)
        except ValueError as exc:
            raise ExplainInputError(f"--session {item!r}: expected steps_per_min=N, cost_usd=USD or "
                                    "pinned=DEPLOYMENT") from exc
    return SessionState("explain", **values)


def _loads(deployments: dict[str, Any], items: Sequence[str]) -> dict[str, DeploymentLoad]:
    loads = {name: DeploymentLoad() for name in deployments}
    names = {f.name for f in fields(DeploymentLoad)}
    for item in items:
        name, _, assignment = item.partition(":")
        field, _, value = assignment.partition("=")
        if name not in loads or field not in names or not value:
            raise ExplainInputError(f"--load {item!r}: expected DEPLOYMENT:FIELD=VALUE with a deployment of the "
                                    f"policy ({', '.join(loads)}) and a field among {', '.join(sorted(names))}")
        try:
            parsed: Any = bool(int(value)) if field == "healthy" else float(value)
        except ValueError as exc:
            raise ExplainInputError(f"--load {item!r}: {value!r} is not a number") from exc
        loads[name] = replace(loads[name], **{field: parsed})
    return loads


def render(report: dict[str, Any]) -> str:
    lines = [f"deployment: {report['deployment']}", f"rule: {report['rule']}",
             f"attempts: {', '.join(report['attempts'])}"]
    if report["complexity"] is not None:
        lines.append(f"complexity: {report['complexity']:.3f}")
        lines += [f"  {name}: {weight:+.3f}" for name, weight in report["top_features"]]
    lines.append("reasons:")
    lines += [f"  - {reason}" for reason in report["reasons"]]
    lines.append("features: " + json.dumps(report["features"]))
    lines.append("load: " + json.dumps(report["load"]))
    return "\n".join(lines)
