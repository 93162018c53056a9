"""Derive the compact session set (data/*.jsonl.gz) from public trajectory files in a fetched git mirror.

    python -m evals.session_cache.derive --git-dir DIR --commit SHA --under PATH --source NAME --out FILE

Each run becomes one JSON line: where it came from, and per message what a replay needs and no more: its role,
its tokens (cl100k, the gateway's count), a short hash of its text (prefixes match where hashes do), for an
assistant turn the hash of the command it ran (repeated calls), for a tool result whether the gateway's verdict
reads it as failed (gateway/agents/tool_outcomes.py) and the exit code it reported.
No text is kept. mini-swe-agent's bash-only turns become tool calls: an assistant message's ```bash block is
the call, the next user message (<returncode>, <output>) its result, as a tool-calling agent sends them.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

from gateway.agents.tool_outcomes import judge
from gateway.features import count_tokens

BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)```", re.DOTALL)
RETURN_CODE = re.compile(r"<returncode>(-?\d+)</returncode>")


def short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


def derive_mini(messages: list[dict[str, Any]]) -> list[list[Any]]:
    """[role, tokens, hash, extra] per message; role s(ystem), u(ser), a(ssistant: extra = command hash),
    t(ool result: extra = [failed 0/1 by the gateway's verdict, exit code or null])."""
    out: list[list[Any]] = []
    after_call = False
    for message in messages:
        role, text = message.get("role"), str(message.get("content") or "")
        tokens = count_tokens(text) if len(text) < 200_000 else len(text) // 4
        if role == "system":
            out.append(["s", tokens, short_hash(text), None])
        elif role == "assistant":
            found = BASH_BLOCK.search(text)
            out.append(["a", tokens, short_hash(text), short_hash(found.group(1).strip()) if found else None])
            after_call = found is not None
        elif role == "user" and after_call:
            code = RETURN_CODE.search(text)
            error = 1 if judge(text, None).failed else 0
            out.append(["t", tokens, short_hash(text), [error, int(code.group(1)) if code else None]])
            after_call = False
        elif role == "user":
            out.append(["u", tokens, short_hash(text), None])
    return out


def files(git_dir: str, commit: str, under: str) -> Iterator[str]:
    listed = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit, under],
                            capture_output=True, text=True, check=True, timeout=60).stdout
    yield from sorted(p for p in listed.splitlines() if p.endswith(".traj.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git-dir", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--under", required=True)
    parser.add_argument("--source", required=True, help="owner/name of the public repository")
    parser.add_argument("--agent", default="mini-swe-agent")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with gzip.open(args.out, "wt", encoding="utf-8") as out:
        for path in files(args.git_dir, args.commit, args.under):
            raw = subprocess.run(["git", "--git-dir", args.git_dir, "show", f"{args.commit}:{path}"],
                                 capture_output=True, check=True, timeout=60).stdout
            run = json.loads(raw)
            messages = derive_mini(run.get("messages") or [])
            if sum(1 for m in messages if m[0] == "a") < 2:
                continue
            line = {"id": path.rsplit("/", 1)[-1].removesuffix(".traj.json"), "agent": args.agent,
                    "source": f"{args.source}@{args.commit[:12]}:{path}", "messages": messages}
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
