"""`policy explain` offline: one request file through the pure decision with assumed load, no deployment called."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.apis.chat import wire as chat_wire
from gateway.apis.routes import BY_ENDPOINT
from gateway.context.tool_outputs import masked_body
from gateway.decision.admission import (
    ANONYMOUS,
    Admission,
    SessionState,
    TenantSnapshot,
    WindowUsage,
    costs_of,
    judge,
    needs_admission,
    window_bucket,
)
from gateway.decision.call import Call, read_call
from gateway.decision.explain import explanation
from gateway.decision.gathering import ColdStart, Surroundings, gather
from gateway.decision.routing import DeploymentLoad, decide
from gateway.policy import model as policy_module
from gateway.policy.tenancy import Window

if TYPE_CHECKING:
    from gateway.classifier.scoring import Classifier


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
    adapter = BY_ENDPOINT.get(endpoint)
    if adapter is None:
        raise ExplainInputError(f"--endpoint {endpoint!r}: expected one of {', '.join(BY_ENDPOINT)}")
    body, managed = adapter.manage_context(adapter.parse(raw).body)
    shape, masking = adapter.tool_outputs, None
    rule = policy.mask_rule(str(body.get("model")), tenant) if shape is not None else None
    if shape is not None and rule is not None:  # what the gateway would mask (nothing is stored offline)
        body, masking = masked_body(shape, body, rule)
    view = adapter.view(body)
    given = _headers(headers)
    call = read_call(policy, endpoint, body, view, len(raw), adapter.features(view), given, tenant, context=managed,
                     masking=masking)
    verdict, state = _admission(policy, call, spent, session)
    scoring = ColdStart(_default_classifier)
    ctx = gather(call, scoring, Surroundings(load=_loads(policy.deployments, loads), admission=verdict,
                                             session=state))
    decision = decide(policy, call.features, ctx, explain=True)

    report = explanation(decision, call.features, ctx, call.context, call.masking)
    top = scoring.model(policy).explain(call.features) if ctx.complexity is not None else []
    report["top_features"] = [[name, round(weight, 4)] for name, weight in top]
    return report


def _default_classifier() -> Classifier:
    from gateway.classifier.scoring import Classifier  # loaded only when a rule reads the score

    return Classifier.default()


def _headers(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise ExplainInputError(f"--header {item!r}: expected NAME:VALUE")
        out[name.strip().lower()] = value.strip()
    return out


def _admission(
    policy: policy_module.Policy, call: Call, spent: Sequence[str], session: Sequence[str]
) -> tuple[Admission | None, SessionState | None]:
    """The budget verdict with assumed spend (`--spent-usd day=45`) and session (`--session pinned=hq`)."""
    tenant, headers = call.tenant, call.headers
    if not (needs_admission(policy, headers) or spent or session):
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
    state = _session(session, call.session_id) if session else None
    costs = costs_of(policy, call.features, call.body_bytes, chat_wire.choices_of(call.view, call.endpoint))
    return judge(policy, costs, headers, snapshot, state), state


def _session(items: Sequence[str], session_id: str | None) -> SessionState:
    """The assumed state of the request's session (its headers or conversation name it; else "assumed")."""
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
    return SessionState(session_id or "assumed", **values)


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
