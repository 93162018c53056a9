"""`python -m evals.context_masking`: public coding-agent runs replayed through a policy's context rules (old tool
outputs masked, old turns summarized).

    python -m evals.context_masking [--policy policies/long-runs.yaml] [--data FILE.jsonl.gz] [--limit N]
                                    [--rule keep_last=K,over_tokens=N,batch_tokens=N,head_chars=N,tail_chars=N]
                                    [--summarize over_tokens=N,keep_tokens=N,summary_tokens=N]
                                    [--window TOKENS] [--sweep] [--json]

Prints, for auto with the policy's context rules (route `auto`; `--rule` and `--summarize` override fields of
them), auto unmanaged (the same policy with both off) and every step on fast with them: the prompt tokens the
agents sent and the
deployments received, the tokens the pair prefilled against one unmanaged deployment serving every step, the
share of steps whose received prompt no longer starts with the step before's (the prefix moved), and the steps
over a window. `--sweep` adds a grid of rules (keep_last, batch_tokens, head/tail characters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from evals.context_masking.replay import (
    CHARS_PER_TOKEN,
    STUB_FRAME_TOKENS,
    parse_evict,
    parse_rule,
    replay,
    rule_dict,
    sweep,
    window_of,
)
from evals.session_cache.__main__ import DATA, ROOT
from gateway.context.masking import MaskRule
from gateway.policy import model as policy_module

MODEL = "auto"  # the route whose masking rule is replayed


def render(rules: dict[str, dict[str, int] | None], rows: list[dict[str, Any]], window: int | None) -> str:
    first, rule = rows[0], rules["mask_tool_outputs"]
    head = (f"{'routing':15} {'sent/sess':>10} {'recv/sess':>10} {'recv/sent':>9} {'prefilled/sess':>14} "
            f"{'vs one unmanaged':>16} {'prefix moved':>12} {'over window':>11} {'fast':>6} {'hq':>6}")
    sessions = first["sessions"] or 1
    said = "; ".join(f"{name}: {_rule_text(r)}" for name, r in rules.items() if r is not None)
    lines = [f"{said}; {first['sessions']} sessions, {first['steps']:,} steps", head, "-" * len(head)]
    for r in rows:
        over = "-" if window is None else f"{r['over_window_steps']:,}"
        lines.append(f"{r['routing']:15} {r['sent_tokens'] / sessions:>10,.0f} "
                     f"{r['received_tokens'] / sessions:>10,.0f} "
                     f"{r['received_over_sent']:>9.1%} {r['prefilled_tokens'] / sessions:>14,.0f} "
                     f"{r['prefilled_vs_unmanaged_one']:>15.2f}x {r['prefix_moved_share']:>12.1%} {over:>11} "
                     f"{r['fast_share']:>6.1%} {r['hq_share']:>6.1%}")
    lines.append(f"(a stub taken as {STUB_FRAME_TOKENS} + (head_chars + tail_chars) / {CHARS_PER_TOKEN:g} tokens, the "
                 "whole output when shorter; vs one unmanaged: the tokens prefilled against one deployment serving "
                 "every step unmasked; prefix moved: steps whose received prompt does not start with the step "
                 "before's)")
    lines.append(f"largest prompt: {first['largest_sent']:,} tokens sent, {first['largest_received']:,} received; "
                 + ("window: none checked (the policy's deployments set no max_model_len; --window N checks one)"
                    if window is None else f"over the {window:,}-token window: the column above"))
    if rule is not None:
        lines.append(f"tool outputs older than the newest {rule['keep_last']}: {first['older_outputs_share']:.1%} of "
                     "the tokens sent (what masking could save if stubs were free)")
    evict = rules["summarize_old_turns"]
    if evict is not None:
        lines.append(f"summaries of old turns: {first['summaries_per_session']:.2f} a session, written on fast "
                     f"between steps, their prompts {first['summary_prompt_share']:.1%} of what auto's pair received "
                     f"(in the figures above); a summary taken as {evict['summary_tokens']} tokens, its bound")
    return "\n".join(lines)


def render_sweep(rows: list[dict[str, Any]]) -> str:
    head = (f"{'keep_last':>9} {'batch_tokens':>12} {'head/tail':>9} {'recv/sent':>9} {'prefix moved':>12} "
            f"{'auto pair vs one unmanaged':>26} {'one masked vs one unmanaged':>27}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rule = r["rule"]
        lines.append(f"{rule['keep_last']:>9} {rule['batch_tokens']:>12} {rule['head_chars']:>9} "
                     f"{r['received_over_sent']:>9.1%} {r['prefix_moved_share']:>12.1%} "
                     f"{r['prefilled_vs_unmanaged_one']:>25.2f}x {r['one_deployment_prefilled_vs_unmanaged']:>26.2f}x")
    return "\n".join(lines)


def _rule_text(rule: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in rule.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.context_masking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default=str(ROOT / "policies" / "long-runs.yaml"))
    parser.add_argument("--data", default=str(DATA), help="derived sessions (evals/session_cache/README.md)")
    parser.add_argument("--limit", type=int, help="replay the first N sessions only")
    parser.add_argument("--rule", default="", help="keep_last=K,over_tokens=N,...: fields over the policy's rule")
    parser.add_argument("--summarize", default="", help="over_tokens=N,keep_tokens=N,summary_tokens=N: "
                                                        "summarize_old_turns' fields over the policy's")
    parser.add_argument("--window", type=int, help="count steps over this window (default: the largest "
                                                   "max_model_len the policy's deployments set)")
    parser.add_argument("--sweep", action="store_true", help="also a grid of keep_last, batch_tokens, head/tail")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        policy = policy_module.load(args.policy)
    except policy_module.PolicyError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 2
    base, evict = policy.mask_rule(MODEL, None), policy.evict_rule(MODEL, None)
    if base is None and evict is None and not args.rule:
        print(f"{args.policy} has no context rules on route {MODEL}: give --rule", file=sys.stderr)
        return 2
    try:
        rule = parse_rule(args.rule, base if base is not None else MaskRule()) if base or args.rule else None
        evict = parse_evict(args.summarize, evict) if args.summarize else evict
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    window = window_of(policy, args.window)
    rows = replay(policy, rule, args.data, args.limit, window, evict)
    swept = sweep(policy, rule or MaskRule(), args.data, args.limit) if args.sweep else None
    rules = {"mask_tool_outputs": None if rule is None else rule_dict(rule),
             "summarize_old_turns": None if evict is None else dataclasses.asdict(evict)}
    if args.json:
        print(json.dumps({"rules": rules, "window": window, "rows": rows, "sweep": swept}, indent=2))
    else:
        print(render(rules, rows, window))
        if swept is not None:
            print()
            print(render_sweep(swept))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
