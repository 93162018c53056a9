"""judge: a tool result's outcome from what the tool and its harness report, words only in a failure's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evals.tool_outcomes import AGENTS, ALONE, HERE, SHOWN, TARGET, Case, figures, load, new_check, old_check, views
from gateway.agents.tool_outcomes import HEAD_CHARS, Source, Verdict, judge

ROOT = Path(__file__).resolve().parents[2]
# A file full of failure words, as `cat` shows it with exit code 0: what the old word check called a failure.
ERROR_WORDS = (ROOT / "gateway" / "errors.py").read_text()
TRACEBACK = ('Traceback (most recent call last):\n  File "/testbed/repro.py", line 3, in <module>\n'
             "    main()\n  File \"/testbed/repro.py\", line 2, in main\n    return {}['k']\nKeyError: 'k'\n")
CODEX_JSON = json.dumps({"output": "FAILED tests/test_a.py::test_x\n", "metadata": {"exit_code": 1,
                                                                                    "duration_seconds": 0.4}})

FORMS = [
    # the harness's exit code wins over whatever the output says
    ("Exit code: 0\nWall time: 0.2 seconds\nOutput:\n" + ERROR_WORDS, False, Source.EXIT_CODE, 0),
    ("Exit code: 1\nWall time: 0.1 seconds\nOutput:\n", True, Source.EXIT_CODE, 1),
    ("Exit code: 2\nWall time: 0.1 seconds\nTotal output lines: 900\nOutput:\nls: x", True, Source.EXIT_CODE, 2),
    ("Chunk ID: 8f2a\nWall time: 0.0123 seconds\nProcess exited with code 1\nOriginal token count: 0\nOutput:\n",
     True, Source.EXIT_CODE, 1),
    # unified exec's header over an output longer than the footer's lines, with no error words (diff, exit 1)
    ("Chunk ID: 19c2\nWall time: 0.0 seconds\nProcess exited with code 1\nOriginal token count: 29\nOutput:\n"
     + "\n".join(f"< line {i}\n---\n> line {i + 1}" for i in range(8)), True, Source.EXIT_CODE, 1),
    ("Chunk ID: 8f2a\nWall time: 1.0 seconds\nProcess exited with code 0\nOutput:\nTraceback: in the docs", False,
     Source.EXIT_CODE, 0),
    ("Chunk ID: 8f2a\nWall time: 10.0 seconds\nProcess running with session ID 3\nOutput:\nbuilding", None,
     Source.RUNNING, None),
    (CODEX_JSON, True, Source.EXIT_CODE, 1),
    (json.dumps({"output": "error: all fine", "metadata": {"exit_code": 0, "duration_seconds": 0.1}}), False,
     Source.EXIT_CODE, 0),
    ("Exit code 127\nbash: rgg: command not found", True, Source.EXIT_CODE, 127),  # Claude Code's Bash
    ("<returncode>0</returncode>\n<output>\n" + ERROR_WORDS + "</output>", False, Source.EXIT_CODE, 0),
    ("<returncode>1</returncode>\n<output>\n</output>", True, Source.EXIT_CODE, 1),  # grep found nothing
    ("collected 3 items\n\n[Python interpreter: /usr/bin/python]\n[Command finished with exit code 1]", True,
     Source.EXIT_CODE, 1),
    ("npm warn\n[The command completed with exit code 0.]\n[Current working directory: /workspace]", False,
     Source.EXIT_CODE, 0),
    ("Serving on :8000\n[The command has no new output after 10 seconds. You may wait longer to see additional "
     "output by sending empty command '']", None, Source.RUNNING, None),
    ("STDOUT:\n\nSTDERR:\nboom\n\nProcess exited with code 3", True, Source.EXIT_CODE, 3),
    ("An error occurred while running the tool. Please try again. Error: timeout", True, Source.HARNESS_ERROR, None),
    ("<tool_use_error>File has not been read yet.</tool_use_error>", True, Source.HARNESS_ERROR, None),
    # a JSON object that says so itself
    ('{"error": "rate limited", "retry_after_s": 3}', True, Source.JSON_ERROR, None),
    ('{"isError": true, "content": [{"type": "text", "text": "no such repo"}]}', True, Source.JSON_ERROR, None),
    ('{"error": null, "items": ["an error log line"]}', None, Source.NONE, None),
    # no structured signal: words only in the shape a failure prints them
    (TRACEBACK, True, Source.TRACEBACK, None),
    ("Creating test database...\n" + TRACEBACK.replace("KeyError: 'k'", "django.core.exceptions.EmptyResultSet"),
     True, Source.TRACEBACK, None),
    ("src/a.c:3:5: error: expected ';' before '}' token\n", True, Source.ERROR_LINE, None),
    ("fatal: not a git repository (or any of the parent directories): .git\n", True, Source.ERROR_LINE, None),
    ("gateway/x.py:4: error: Function is missing a type annotation  [no-untyped-def]\nFound 1 error in 1 file\n",
     True, Source.ERROR_LINE, None),
    ("F\n=========== 1 failed, 2 passed in 0.12s ===========\n", True, Source.ERROR_LINE, None),
    ("\x1b[31m========== \x1b[32m110 passed\x1b[0m, \x1b[31m\x1b[1m4 errors\x1b[0m\x1b[31m in 6.07s\x1b[0m"
     "\x1b[31m ==========\x1b[0m\n", True, Source.ERROR_LINE, None),  # pytest's summary in colour
    ("usage: manage.py cheeses create [-h] name\nmanage.py cheeses create: error: the following arguments are "
     "required: name\n", True, Source.ERROR_LINE, None),  # argparse
    ("bash: line 1: rgg: command not found\n", True, Source.NOT_FOUND, None),
    ("cat: gateway/nope.py: No such file or directory\n", True, Source.NOT_FOUND, None),
    ("/usr/bin/python3: No module named pytest\n", True, Source.NOT_FOUND, None),
    # the traps: failure words in a file's text, and failures that say nothing
    (ERROR_WORDS, None, Source.NONE, None),
    ("    raise ValueError('error: bad input')  # not found, denied, failed\n", None, Source.NONE, None),
    ("def test_error():\n    assert 'Traceback' in log\n", None, Source.NONE, None),
    ("Error: no table at 8", True, Source.ERROR_LINE, None),  # a function tool whose whole answer is its error
    ("year lookup:\nError: Cannot resolve keyword 'year'\n", None, Source.NONE, None),  # a script's own print
    ("", None, Source.NONE, None),  # grep that found nothing, `test -f missing`: nothing says it failed
    ("  1\tfrom gateway.errors import GatewayError\n  2\traise GatewayError('invalid')\n", None, Source.NONE, None),
]


@pytest.mark.parametrize(("text", "failed", "source", "exit_code"), FORMS)
def test_each_form_gives_its_verdict(text: str, failed: bool | None, source: Source, exit_code: int | None) -> None:
    assert judge(text) == Verdict(failed, source, exit_code)


def test_the_apis_own_flag_wins_and_its_absence_leaves_the_text_to_judge() -> None:
    assert judge("done", is_error=True) == Verdict(True, Source.IS_ERROR)
    assert judge("Exit code: 0\nOutput:\n", is_error=None).failed is False
    assert judge(ERROR_WORDS, is_error=False) == Verdict(False, Source.IS_ERROR)
    assert judge(TRACEBACK, is_error=False) == Verdict(False, Source.IS_ERROR)  # words yield to the flag
    assert judge(TRACEBACK, is_error=None).failed is True
    assert judge("Exit code: 2\nOutput:\n", is_error=False) == Verdict(True, Source.EXIT_CODE, 2)  # a harness's code


def test_a_long_output_is_judged_by_its_two_ends() -> None:
    middle = "x = 1\n" * 50_000
    assert judge("<returncode>2</returncode>\n" + middle).exit_code == 2
    assert judge(middle + "[Command finished with exit code 1]").exit_code == 1
    assert judge(middle + TRACEBACK).source == Source.TRACEBACK
    assert judge(middle[:HEAD_CHARS] + "error: in the middle\n" + middle).source == Source.NONE


@given(st.text(max_size=3000))
def test_any_text_gets_a_verdict_without_raising(text: str) -> None:
    verdict = judge(text)
    assert verdict.failed in (True, False, None) and verdict.ok is (verdict.failed is not True)


# The committed labelled set (evals/tool_outcomes/README.md): real exit codes against the verdict.
ROWS = load()


def test_with_the_harness_exit_code_in_the_text_the_verdict_meets_the_target() -> None:
    found = figures(views(ROWS)[SHOWN], new_check)
    assert found.failed >= 100
    assert found.precision >= TARGET and found.recall >= TARGET


def test_from_the_output_alone_the_verdict_is_precise_and_beats_the_word_check() -> None:
    """No exit code in the text: a failure that prints nothing cannot be told, so only precision has the target."""
    cases = views(ROWS)[ALONE]
    new, old = figures(cases, new_check), figures(cases, old_check)
    assert new.precision >= TARGET
    assert new.precision > old.precision and new.recall > old.recall


def test_on_the_real_agents_results_the_verdict_meets_the_target() -> None:
    """Codex's and Claude Code's own results from our runs (evals/tool_outcomes/agent_runs.py). The misses are
    Claude Code's: a grep that matched nothing, `test -f` false, `diff` of different files exit 1, and Claude Code
    itself sends them with is_error false (for it they are answers, not failures); the verdict takes its word."""
    rows = [row for row in ROWS if row["source"] in ("codex", "claude-code")]
    found = figures(views(rows)[AGENTS], new_check)
    assert found.cases >= 100 and found.failed >= 20
    assert found.precision >= TARGET and found.recall >= TARGET, found
    missed = [row for row in rows
              if row["exit_code"] != 0 and not new_check(Case(row["text"], True, row.get("is_error")))]
    assert {row["source"] for row in missed} <= {"claude-code"}
    assert all(row["is_error"] is False and row["command"].split()[0] in ("grep", "test", "diff") for row in missed)


def test_the_modules_of_this_repository_cat_clean() -> None:
    cats = [Case(row["text"], row["exit_code"] != 0) for row in ROWS
            if row["source"] == "local" and row["command"].startswith("cat gateway/")
            and "no_such" not in row["command"]]
    assert len(cats) > 100 and not any(c.failed for c in cats)
    assert [c.text[:60] for c in cats if new_check(c)] == []
    assert sum(old_check(c) for c in cats) > 30  # what the old check made of them
    assert len(views(ROWS)[HERE]) == sum(row["source"] == "local" for row in ROWS)
