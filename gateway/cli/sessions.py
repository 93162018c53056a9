"""The `sessions list|show|export` sub-commands: recorded agent trajectories and their outcomes, as clients of
the admin API."""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
from typing import Any

from gateway.cli.admin_client import CliError, client_options, guarded, request
from gateway.cli.session_labels import label

SORTS = ("recent", "cost", "steps", "rate")


def cmd_list(args: argparse.Namespace) -> int:
    query = {"sort": args.sort, "limit": str(args.limit), **({"tenant": args.tenant} if args.tenant else {})}
    found = request(args, "GET", "/admin/sessions?" + urllib.parse.urlencode(query))
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    rows = found.get("data", [])
    if not rows:
        print("no recorded sessions" + (f" of tenant {args.tenant!r}" if args.tenant else ""))
        return 0
    print(f"{'SESSION':32} {'TENANT':14} {'STEPS':>5} {'COST_USD':>10} {'TOKENS IN/OUT':>15} {'STEPS/MIN':>9} "
          f"{'LAST':>8}  {'OUTCOME':8} {'DEPLOYMENTS':18} FLAGS")
    for s in rows:
        tokens = f"{s['tokens_in']}/{s['tokens_out']}"
        deployments = " ".join(f"{name} {n}" for name, n in sorted(s["deployments"].items()))
        print(f"{_clip(s['session_id'], 32):32} {_clip(s['tenant'], 14):14} {s['steps']:>5} {s['cost_usd']:>10.6f} "
              f"{tokens:>15} {s['steps_per_min']:>9.1f} {_clock(s['last_at']):>8}  {_outcome_word(s):8} "
              f"{deployments:18} {', '.join(s['flags']) or '-'}")
    return 0


def _outcome_word(session: dict[str, Any]) -> str:
    outcome = session.get("outcome")
    return "-" if outcome is None else ("success" if outcome["success"] else "failure")


def outcome_line(session: dict[str, Any]) -> str:
    """The session's reported outcome, what it replaced, or that none was reported."""
    outcome = session.get("outcome")
    if outcome is None:
        return "  outcome: not reported"
    parts = [_outcome_word(session)]
    if outcome.get("score") is not None:
        parts.append(f"score {outcome['score']:g}")
    parts.append(f"via {outcome['source']} at {_when(outcome['at'])}, after {outcome['steps']} steps and "
                 f"{outcome['cost_usd']:.6f} USD")
    line = "  outcome: " + ", ".join(parts)
    if outcome.get("reason"):
        line += f": {outcome['reason']}"
    if outcome.get("labels"):
        line += " [" + ", ".join(f"{k}={v}" for k, v in sorted(outcome["labels"].items())) + "]"
    earlier = session.get("outcome_history") or []
    if earlier:
        line += f"; replaces {len(earlier)} earlier report(s): " + ", ".join(
            f"{'success' if o['success'] else 'failure'} at {_clock(o['at'])}" for o in earlier)
    return line


def cmd_show(args: argparse.Namespace) -> int:
    path = "/admin/sessions/" + urllib.parse.quote(args.session_id, safe="")
    found = request(args, "GET", path + (f"?tenant={urllib.parse.quote(args.tenant)}" if args.tenant else ""))
    print(json.dumps(found, indent=2) if args.json else timeline(found))
    return 0


def timeline(session: dict[str, Any]) -> str:
    """A session step by step: when, where, tokens, cost, the tools asked for and answered, the flags."""
    lines = [
        f"session {session['session_id']} (tenant {session['tenant']}): {session['step_count']} steps, "
        f"{session['cost_usd']:.6f} USD, {session['tokens_in']} tokens in / {session['tokens_out']} out, "
        f"{session['steps_per_min']:.1f} steps/min; started {_when(session['started_at'])}, "
        f"last {_when(session['last_at'])}",
        f"  flags: {', '.join(session['flags']) or 'none'}",
        outcome_line(session),
        f"{'STEP':>5} {'TIME':>8}  {'DEPLOYMENT':12} {'RULE':22} {'ARM':9} {'IN/OUT':>11} {'COST_USD':>10} "
        f"{'LATENCY':>9} {'STATUS':>6}  TOOLS / FLAGS",
    ]
    for step in session["steps"]:
        tokens = f"{step['tokens_in']}/{step['tokens_out']}"
        latency = f"{step['latency_ms']:.0f} ms"
        lines.append(f"{step['step']:>5} {_clock(step['at']):>8}  {_clip(step['deployment'], 12):12} "
                     f"{_clip(step['rule'], 22):22} {step['arm'] or '-':9} {tokens:>11} {step['cost_usd']:>10.6f} "
                     f"{latency:>9} {step['status']:>6}  {_tools(step)}")
        if step["flags"]:
            lines.append(f"{'':>5} {'':>8}  ! {', '.join(step['flags'])}")
        if step.get("cache"):
            lines.append(f"{'':>5} {'':>8}  cache: {cache_line(step['cache'])}")
        if step.get("context"):
            lines.append(f"{'':>5} {'':>8}  context: {context_line(step['context'])}")
        if step.get("compaction"):
            lines.append(f"{'':>5} {'':>8}  compaction by {step['compaction']['by']}: "
                         f"{step['compaction']['cost_usd']:.6f} USD of the step's cost")
    return "\n".join(lines)


def context_line(context: dict[str, Any]) -> str:
    """What the policy's context rules did to a step's prompt: masked outputs, summarized entries, tokens saved."""
    parts = []
    if "masked_outputs" in context:
        parts.append(f"{context['masked_outputs']} tool outputs masked, {context['tokens_saved']:,} tokens saved")
    if "summarized_entries" in context:
        parts.append(f"{context['summarized_entries']} old entries summarized, "
                     f"{context['summary_tokens_saved']:,} tokens saved")
    if "retrieved_pieces" in context:
        parts.append(f"{context['retrieved_pieces']} pieces retrieved, {context['retrieved_tokens']:,} tokens")
    return "; ".join(parts)


def cache_line(cache: dict[str, Any]) -> str:
    """A step's prefix caches: `hq 4,000 cached / 20,000 uncached (warmed), fast ...; reported 23,000 cached;
    moved from hq; warm-up hq started`."""
    warmed = set(cache.get("warmed") or ())
    parts = [", ".join(f"{name} {held:,} cached / {cache['uncached_tokens'].get(name, 0):,} uncached"
                       f"{' (warmed)' if name in warmed else ''}" for name, held in cache["cached_tokens"].items())]
    if cache.get("reported_cached_tokens") is not None:
        parts.append(f"reported {cache['reported_cached_tokens']:,} cached")
    if cache.get("switched_from"):
        parts.append(f"moved from {cache['switched_from']}")
    warm_up = cache.get("warm_up")
    if warm_up:
        parts.append(f"warm-up {warm_up['deployment']} {warm_up['outcome']}")
    return "; ".join(parts)


def _tools(step: dict[str, Any]) -> str:
    sent = [f"<- {r['tool_call_id'] or '?'} {'ok' if r['ok'] else 'ERROR'}{_verdict(r)} ({r['size']} chars)"
            for r in step["tool_results"]]
    asked = [f"-> {c['name']}(args {c['args_digest'][:8]})" for c in step["tool_calls"]]
    return "; ".join(sent + asked) or "-"


def _verdict(result: dict[str, Any]) -> str:
    """What said so: ` [exit_code 2]`, ` [is_error]`, ` [traceback]`, ` [none]` (nothing said; counted ok)."""
    source = result.get("source")
    if not source:  # recorded before verdicts named their source
        return ""
    code = result.get("exit_code")
    return f" [{source}{'' if code is None else f' {code}'}]"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


EXPORT_LIMIT = 1000  # the admin API's most per listing


def cmd_export(args: argparse.Namespace) -> int:
    """Every listed session with its steps, as JSONL; with --with-outcomes, as classifier label rows."""
    query = {"sort": "recent", "limit": str(EXPORT_LIMIT), **({"tenant": args.tenant} if args.tenant else {})}
    listed = request(args, "GET", "/admin/sessions?" + urllib.parse.urlencode(query)).get("data", [])
    sessions = []
    for s in listed:
        path = "/admin/sessions/" + urllib.parse.quote(s["session_id"], safe="")
        sessions.append(request(args, "GET", f"{path}?tenant={urllib.parse.quote(s['tenant'])}"))
    rows = sessions
    if args.with_outcomes:
        labelled = label(sessions, args.strong, args.weak)
        rows = labelled.rows
        print(f"{len(sessions)} sessions: {labelled.summary()} -> {args.out}")
    else:
        print(f"{len(sessions)} sessions -> {args.out}")
    try:
        with open(args.out, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, separators=(",", ":")) + "\n")
    except OSError as exc:
        raise CliError(f"{args.out}: {exc.strerror}") from None
    return 0


def _session_options(parser: argparse.ArgumentParser) -> None:
    client_options(parser)
    parser.add_argument("--tenant", help="only this tenant's sessions")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `sessions list|show|export` to the agent-gateway parser."""
    sessions = subparsers.add_parser("sessions", help="recorded agent trajectories: list them, show one, export")
    sub = sessions.add_subparsers(dest="sessions_command", required=True)
    listing = sub.add_parser("list", help="sessions with steps, cost, rate, deployments and flags")
    listing.add_argument("--sort", choices=SORTS, default="recent", help="largest first (default: most recent)")
    listing.add_argument("--limit", type=int, default=50)
    _session_options(listing)
    listing.set_defaults(func=guarded(cmd_list))
    show = sub.add_parser("show", help="one session's timeline, step by step")
    show.add_argument("session_id", help="the id its client sent (x-session-id), as `sessions list` shows it, "
                      "e.g. run-42")
    _session_options(show)
    show.set_defaults(func=guarded(cmd_show))
    export = sub.add_parser("export", help="sessions with their steps as JSONL; --with-outcomes: as classifier labels")
    export.add_argument("--out", required=True, help="the JSONL file to write")
    export.add_argument("--with-outcomes", action="store_true",
                        help="label rows `classifier train --labels` reads, from the sessions' reported outcomes")
    export.add_argument("--strong", default="hq", help="the deployment a failed task's rerun succeeded on")
    export.add_argument("--weak", default="fast", help="the deployment whose steps are labelled")
    _session_options(export)
    export.set_defaults(func=guarded(cmd_export))
