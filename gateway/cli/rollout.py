"""The `rollout` and `shadow report|labels` sub-commands: clients of the admin HTTP API (or of a JSONL export)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway.cli.admin_client import CliError, client_options, guarded, request
from gateway.rollout.comparison import format_report, summarize

ACTIONS = ("promote", "pause", "resume", "abort", "retry", "undo")


def _route_path(route: str, *rest: str) -> str:
    return "/admin/rollouts/" + "/".join(urllib.parse.quote(p, safe="") for p in (route, *rest))


def _fmt_interval(interval: list[float | None] | None) -> str:
    if not interval or interval[0] is None or interval[1] is None:
        return "-"
    return f"[{interval[0]:.4g}, {interval[1]:.4g}]"


def format_status(route: str, st: dict[str, Any]) -> str:
    step = f"{st['step_index']}/{st['step_count']}"
    lines = [
        f"{route}: {st['phase']}  rollout {st['rollout_id']}  "
        f"{st.get('stable') or 'stable'} -> {st['candidate']}",
        f"  step {step} {json.dumps(st.get('step'))}  weight {st['weight_pct']:g}%"
        f"  shadow {st['shadow_pct']:g}%"
        f"  generation {st['generation']}",
        f"  samples: candidate {st['samples']['candidate']}, control {st['samples']['control']}"
        + (f"  held {st['hold_s']:.0f}s of {st['max_hold_s']:.0f}s" if st.get("hold_s") is not None else ""),
    ]
    lines += [f"  reason: {r}" for r in st.get("reasons", [])]
    for m in st.get("metrics", []):
        est = "-" if m["estimate"] is None else f"{m['estimate']:.4g}"
        lines.append(
            f"  {m['metric']:16} {m['status']:13} n={m['n']:<6} est={est:<8} {_fmt_interval(m['interval'])}"
        )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    if args.route:
        found = {args.route: request(args, "GET", _route_path(args.route))}
    else:
        found = request(args, "GET", "/admin/rollouts")
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print("\n\n".join(format_status(route, st) for route, st in found.items()) or "no rollouts")
    return 0


def cmd_action(args: argparse.Namespace) -> int:
    action = "promote_full" if args.action == "promote" and args.full else args.action
    generation = args.generation
    if generation is None:  # the state the user acts on is the one just read; a race still gets 409
        generation = request(args, "GET", _route_path(args.route))["generation"]
    body = {"actor": args.actor, "reason": args.reason, "generation": generation}
    st = request(args, "POST", _route_path(args.route, action), body)
    print(json.dumps(st, indent=2) if args.json else format_status(args.route, st))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    entries = request(args, "GET", _route_path(args.route, "history"))
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        print(
            f"{e['at']:.3f}  gen {e['generation']:<4} {e['action']:18} {e['phase']:11}"
            f" step {e['step_index']:<3}"
            f" weight {e['weight_pct']:g}%  by {e['actor']}: {e['reason']}"
        )
    return 0


def cmd_shadow_report(args: argparse.Namespace) -> int:
    if args.file:
        records = _read_jsonl(args.file)
    else:
        records = request(
            args, "GET", "/admin/shadow/pairs" + (f"?target={args.target}" if args.target else "")
        )
    summary = summarize(records, margin=args.margin)
    print(json.dumps(summary, indent=2) if args.json else format_report(summary))
    return 0


def cmd_shadow_labels(args: argparse.Namespace) -> int:
    """Export the gateway's shadow-pair labels as JSONL, the input of `classifier train --labels`."""
    records = request(args, "GET", f"/admin/shadow/labels?limit={args.limit}")
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        try:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise CliError(f"{args.out}: {exc.strerror}") from None
    verdicts = {v: sum(1 for r in records if r.get("verdict") == v) for v in ("weak_worse", "tie", "weak_better")}
    with_text = sum(1 for r in records if "body" in r)
    print(f"{len(records)} labels ({', '.join(f'{k} {n}' for k, n in verdicts.items())}; {with_text} with prompt text)"
          + ("" if args.out == "-" else f" -> {args.out}"), file=sys.stderr)
    return 0


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except ValueError as exc:
                        raise CliError(f"{path}:{number}: not a JSON object ({exc})") from None
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror}") from None
    return records


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `rollout …` and `shadow report` to the agent-gateway parser."""
    rollout = subparsers.add_parser("rollout", help="watch and steer gradual rollouts")
    sub = rollout.add_subparsers(dest="rollout_command", required=True)
    status = sub.add_parser("status", help="phase, weight and per-metric verdicts")
    status.add_argument("route", nargs="?")
    client_options(status)
    status.set_defaults(func=guarded(cmd_status))
    for action in ACTIONS:
        p = sub.add_parser(action, help=f"{action} the route's rollout (audited)")
        p.add_argument("route")
        p.add_argument(
            "--reason", required=action in ("abort", "undo"), default="", help="recorded in history"
        )
        p.add_argument("--actor", default=os.environ.get("USER") or "cli", help="recorded in history")
        p.add_argument("--generation", type=int, default=None, help="act only if the state is still at it")
        if action == "promote":
            p.add_argument("--full", action="store_true", help="skip every remaining step")
        client_options(p)
        p.set_defaults(func=guarded(cmd_action), action=action, full=False)
    history = sub.add_parser("history", help="audited transitions, oldest first")
    history.add_argument("route")
    client_options(history)
    history.set_defaults(func=guarded(cmd_history))

    shadow = subparsers.add_parser("shadow", help="shadow traffic")
    ssub = shadow.add_subparsers(dest="shadow_command", required=True)
    report = ssub.add_parser("report", help="summarize compared pairs with intervals")
    report.add_argument("--file", help="a JSONL export of pairs (offline; no gateway needed)")
    report.add_argument("--target", help="only pairs of this shadow target (from the gateway)")
    report.add_argument("--margin", type=float, default=0.05, help="win-share non-inferiority margin")
    client_options(report)
    report.set_defaults(func=guarded(cmd_shadow_report))
    labels = ssub.add_parser("labels", help="export the labels of shadow pairs as JSONL (for classifier train)")
    labels.add_argument("--out", default="-", help="JSONL file to write (default: stdout)")
    labels.add_argument("--limit", type=int, default=10_000, help="the newest this many labels")
    client_options(labels)
    labels.set_defaults(func=guarded(cmd_shadow_labels))
