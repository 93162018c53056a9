"""`python -m evals.session_cache`: public coding-agent runs replayed through a policy on a caching fake pair.

    python -m evals.session_cache [--policy policies/default.yaml] [--before FILE] [--data FILE.jsonl.gz]
                                  [--limit N] [--json]

Prints, for auto before (`--before`, default: the policy without its `switch` section) and after, for every step
on hq, every step on fast, and the free-switch bound (auto's routing as if both deployments had cached every
step): the share of steps on each deployment, the switches a session, the tokens prefilled (the pair's against
what one deployment serving every step would prefill), prefill seconds and cost a session.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evals.session_cache.replay import replay
from gateway.policy import model as policy_module

DATA = Path(__file__).parent / "data" / "mini-swe-agent-gemini-3-pro.jsonl.gz"
ROOT = Path(__file__).resolve().parents[2]


def render(rows: list[dict[str, object]]) -> str:
    head = (f"{'routing':18} {'steps':>6} {'fast':>6} {'hq':>6} {'switches':>9} {'prefilled':>10} "
            f"{'vs one':>7} {'prefill s':>10} {'cost $':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['routing']:18} {r['steps']:>6} {r['fast_share']:>6.1%} {r['hq_share']:>6.1%} "
                     f"{r['switches_per_session']:>9.2f} {r['prefilled_per_session']:>10,.0f} "
                     f"{r['prefilled_vs_one']:>6.2f}x {r['prefill_s_per_session']:>10.2f} "
                     f"{r['cost_usd_per_session']:>8.4f}")
    lines.append("(per session: switches, tokens prefilled, prefill seconds at the policy's prefill_ms_per_1k_tokens, "
                 "cost with cached input at 10% of the input price; vs one: the pair's prefill against one deployment "
                 "serving every step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.session_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default=str(ROOT / "policies" / "default.yaml"))
    parser.add_argument("--before", help="the policy to compare (default: --policy without its switch section)")
    parser.add_argument("--data", default=str(DATA), help="derived sessions (evals/session_cache/README.md)")
    parser.add_argument("--limit", type=int, help="replay the first N sessions only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        policy = policy_module.load(args.policy)
        before = policy_module.load(args.before) if args.before else policy.model_copy(update={"switch": None})
    except policy_module.PolicyError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 2
    rows = replay(policy, before, args.data, args.limit)
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
