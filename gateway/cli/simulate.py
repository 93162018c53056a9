"""Offline replay: `policy simulate` runs the pure decision of a candidate policy over a logged request log.

Nothing is called: every logged request's features, headers, tenant and complexity score are fed to
decide() with every deployment assumed healthy and idle (a policy naming its own `classifier` rescores the
requests whose prompt the log kept). Projected cost prices each request's logged
token usage at the chosen deployment's prices (the tokens a different deployment would have produced
are not known, so this is the cost of the same tokens, not a prediction of output length).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from gateway.agents.steps import AgentStep
from gateway.apis.usage import reported_usage
from gateway.decision.call import Call
from gateway.decision.gathering import Logged, Surroundings, gather
from gateway.decision.routing import decide
from gateway.errors import GatewayError
from gateway.features import Features
from gateway.policy import model as policy_module
from gateway.policy.model import Policy

SHOWN_CHANGES = 20
_FEATURES = [f.name for f in fields(Features)]


@dataclass
class Tally:
    """One policy's replay: requests per deployment and the projected cost."""

    shares: Counter[str] = field(default_factory=Counter)
    cost_usd: float = 0.0


def read_log(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None


def features_of(record: dict[str, Any]) -> Features:
    raw = record.get("features") or {}
    values: dict[str, Any] = {name: raw.get(name) for name in _FEATURES}
    values["last_user_text"] = raw.get("last_user_text") or ""
    return Features(**values)


def _choice(policy: Policy, call: Call, complexity: float | None) -> tuple[str, str]:
    """The policy's decision of a logged call, gathered as the live gateway gathers it (load assumed idle)."""
    try:
        found = decide(policy, call.features, gather(call, Logged(complexity), Surroundings()))
    except GatewayError as exc:
        return f"error:{exc.code}", ""
    return found.deployment, found.rule


def call_of(policy: Policy, record: dict[str, Any]) -> Call:
    """A logged request as the call the live gateway read: features, headers, tenant and agent step."""
    features = features_of(record)
    step = record.get("step")
    return Call(policy, features.endpoint, {}, {}, 0, features, record.get("headers") or {}, record.get("tenant"),
                AgentStep(**step) if isinstance(step, dict) else None)


def _cost(policy: Policy, deployment: str, usage: dict[str, Any] | None) -> float:
    """The logged usage at the deployment's prices: its cached tokens (0 in logs written before they were read)
    at the cached price, on whichever deployment the policy sends the request (the session's cache is assumed
    to follow it: a replay of one request at a time cannot see the switches a policy makes)."""
    dep = policy.deployments.get(deployment)
    if dep is None or not usage:
        return 0.0
    logged = reported_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                                   usage.get("cached_tokens"))
    return dep.price.cost_usd_of(logged)


def replay(path: str, candidate: Policy, live: Policy | None) -> dict[str, Any]:
    """Both policies' tallies and the changed decisions; the live side is the logged one without `live`."""
    tallies = {"live": Tally(), "candidate": Tally()}
    changes: list[dict[str, Any]] = []
    total = 0
    for _, record in read_log(path):
        complexity = record.get("complexity")
        logged = record.get("decision") or {}
        if live is not None:
            was, was_rule = _choice(live, call_of(live, record), complexity)
        else:
            was, was_rule = logged.get("deployment", "?"), logged.get("rule", "?")
        features = features_of(record)
        now, now_rule = _choice(candidate, call_of(candidate, record), complexity)
        usage = record.get("usage")
        pricing = live or candidate
        for name, (dep, pol) in {"live": (was, pricing), "candidate": (now, candidate)}.items():
            tallies[name].shares[dep] += 1
            tallies[name].cost_usd += _cost(pol, dep, usage)
        total += 1
        if was != now:
            changes.append(
                {
                    "request_id": record.get("request_id"),
                    "model": features.requested_model,
                    "live": f"{was} ({was_rule})",
                    "candidate": f"{now} ({now_rule})",
                }
            )
    return {
        "requests": total,
        "tallies": {k: {"shares": dict(v.shares), "cost_usd": v.cost_usd} for k, v in tallies.items()},
        "changed": len(changes),
        "changes": changes,
    }


def render(report: dict[str, Any]) -> str:
    n = report["requests"] or 1
    live, cand = report["tallies"]["live"], report["tallies"]["candidate"]
    lines = [
        f"requests replayed: {report['requests']}",
        "",
        f"{'deployment':24} {'live':>14} {'candidate':>14}",
    ]
    for dep in sorted(set(live["shares"]) | set(cand["shares"])):
        a, b = live["shares"].get(dep, 0), cand["shares"].get(dep, 0)
        lines.append(f"{dep:24} {a:>6} {a / n:>6.1%} {b:>7} {b / n:>6.1%}")
    delta = cand["cost_usd"] - live["cost_usd"]
    lines += [
        "",
        f"projected cost (logged tokens at each deployment's prices): live ${live['cost_usd']:.6f}, "
        f"candidate ${cand['cost_usd']:.6f} ({'+' if delta >= 0 else '-'}${abs(delta):.6f})",
        f"decisions changed: {report['changed']} of {report['requests']}",
    ]
    for change in report["changes"][:SHOWN_CHANGES]:
        lines.append(
            f"  {change['request_id']}  {change['model']}: {change['live']} -> {change['candidate']}"
        )
    if report["changed"] > SHOWN_CHANGES:
        lines.append(f"  ... {report['changed'] - SHOWN_CHANGES} more (use --json for all)")
    return "\n".join(lines)


def simulate_command(args: argparse.Namespace) -> int:
    try:
        candidate = policy_module.load(args.policy)
        live = policy_module.load(args.live) if args.live else None
        report = replay(args.log, candidate, live)
    except policy_module.PolicyError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as exc:
        print(f"{args.log}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def add_parser(psub: Any) -> None:
    """`policy simulate`, registered under the core's `policy` command."""
    sim = psub.add_parser("simulate", help="replay a request log through a candidate policy, offline")
    sim.add_argument("--log", required=True, help="JSONL request log (AGENT_GATEWAY_REQUEST_LOG)")
    sim.add_argument("--policy", required=True, help="the candidate policy YAML")
    sim.add_argument("--live", help="the live policy YAML (default: the decisions recorded in the log)")
    sim.add_argument("--json", action="store_true", help="print JSON")
    sim.set_defaults(func=simulate_command)
