"""Build the labelled set of tool results (labelled.jsonl.gz): how each row was taken, so it can be taken again.

    python -m evals.tool_outcomes.build --mini /path/to/gruckion/mini-swe-agent.git [--sample 3000]

Two sources (README.md in this folder says which commit and files):
- mini-swe-agent trajectories: each observation message `<returncode>N</returncode>\\n<output>...` that the harness
  fed back after running the model's command; the label is N, the exit code the harness recorded.
- commands run here, in this repository (cat of every gateway module, failing greps, pytest, mypy, missing
  files, commands that do not exist), each with the exit code bash returned; the text is their stdout and
  stderr as one stream (what an agent's shell tool sends back), with no exit code written into it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "labelled.jsonl.gz"
MINI_REPO = "gruckion/mini-swe-agent"
MINI_GLOB = re.compile(r"^swebench_results/20251118_gemini-3-pro-74pct/trajs/.*\.traj\.json$")
RETURNCODE = re.compile(r"<returncode>(-?\d+)</returncode>")
KEPT_CHARS = 3_000  # a longer text keeps its first and last KEPT_CHARS (the verdict reads 2,000 of each end)


def cap(text: str) -> str:
    if len(text) <= 2 * KEPT_CHARS:
        return text
    return f"{text[:KEPT_CHARS]}\n[... {len(text) - 2 * KEPT_CHARS} characters cut from this row ...]\n" \
           f"{text[-KEPT_CHARS:]}"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def mini_rows(repo: Path) -> Iterator[dict[str, Any]]:
    """Every observation with a recorded return code, from every trajectory of the run."""
    commit = _git(repo, "rev-parse", "HEAD").strip()
    paths = sorted(p for p in _git(repo, "ls-tree", "-r", "--name-only", "HEAD").split("\n") if MINI_GLOB.match(p))
    for path in paths:
        messages = json.loads(_git(repo, "show", f"HEAD:{path}"))["messages"]
        for index, message in enumerate(messages):
            content = message.get("content")
            found = RETURNCODE.match(content) if message.get("role") == "user" and isinstance(content, str) else None
            if found:
                yield {"source": "mini-swe-agent", "repo": MINI_REPO, "commit": commit, "path": path,
                       "message": index, "exit_code": int(found.group(1)), "text": cap(content)}


# Commands as an agent runs them in this repository; {tmp} holds the failing fixtures made below.
COMMANDS = [
    "grep -rn 'no_such_identifier_anywhere' gateway",
    "grep -n 'def judge' gateway/agents/tool_outcomes.py",
    "grep -c 'import' gateway/errors.py",
    "cat gateway/no_such_module.py",
    "ls no_such_dir/",
    "ls gateway/agents",
    "sed -n 1,40p gateway/errors.py",
    "head -30 gateway/agents/steps.py",
    "wc -l gateway/*.py",
    "git log --oneline -5 --format=%s",
    "git show no-such-revision",
    "git status --short gateway/agents",
    "test -f gateway/no_such_module.py",
    "no_such_command --version",
    "python3 -c 'import no_such_module'",
    "python3 -c 'raise SystemExit(3)'",
    "python3 -c \"print('error: the word, printed by a command that succeeds')\"",
    "python3 -c \"import json; print(json.dumps({'error': None, 'items': [1, 2]}))\"",
    "python3 -c \"import json; print(json.dumps({'error': 'rate limited'}))\"",
    "python3 {tmp}/crash.py",
    "python3 {tmp}/no_such_script.py",
    "python3 -m json.tool {tmp}/bad.json",
    "python3 -m pytest {tmp}/test_fails.py -q -p no:cacheprovider",
    "python3 -m pytest {tmp}/test_passes.py -q -p no:cacheprovider",
    "python3 -m mypy --strict {tmp}/typed.py",
    "python3 -m ruff check {tmp}/typed.py",
    "diff {tmp}/crash.py {tmp}/typed.py",
    "cmp {tmp}/crash.py {tmp}/crash.py",
    "find gateway -name '*.pyx'",
    "cd no_such_dir",
    "false",
    "true",
]

FIXTURES = {
    "crash.py": "def main():\n    return {}['missing']\n\nmain()\n",
    "bad.json": "{not json\n",
    "test_fails.py": "def test_sum():\n    assert 1 + 1 == 3\n",
    "test_passes.py": "def test_error_words():\n    assert 'error' in 'an error that is expected'\n",
    "typed.py": "import os\n\ndef f(x):\n    return x + 1\n",
}


def _run(command: str, cwd: Path) -> tuple[int, str]:
    done = subprocess.run(["bash", "-c", f"{command} 2>&1"], cwd=cwd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout


def local_rows(python: str) -> Iterator[dict[str, Any]]:
    """`cat` of every gateway module (exit 0), then COMMANDS, each run here with its real exit code."""
    commit = _git(ROOT, "rev-parse", "HEAD").strip()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gateway").rglob("*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in FIXTURES.items():
            (Path(tmp) / name).write_text(text)
        for command in [f"cat {m}" for m in modules] + COMMANDS:
            code, output = _run(command.replace("python3", python).replace("{tmp}", tmp), ROOT)
            yield {"source": "local", "repo": "agent-gateway", "commit": commit, "command": command,
                   "exit_code": code, "text": cap(output.replace(tmp, "/tmp/fixtures"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mini", type=Path, required=True, help="a clone (or bare mirror) of " + MINI_REPO)
    parser.add_argument("--sample", type=int, default=3000, help="mini-swe-agent observations kept (seeded)")
    parser.add_argument("--python", default="python3", help="the interpreter the local commands run")
    args = parser.parse_args(argv)
    mini = list(mini_rows(args.mini))
    kept = sorted(random.Random(33).sample(range(len(mini)), min(args.sample, len(mini))))
    rows = [mini[i] for i in kept] + list(local_rows(args.python))
    lines = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    with gzip.GzipFile(OUT, "wb", mtime=0) as out:  # no timestamp: the same rows give the same bytes
        out.write(lines.encode("utf-8"))
    print(f"{len(rows)} rows ({len(kept)} of {len(mini)} mini-swe-agent observations) -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
