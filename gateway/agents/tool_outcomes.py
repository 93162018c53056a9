"""Whether a tool call failed, read from what the tool and the agent's harness report about it.

The API's own flag first (Anthropic's `tool_result.is_error`), then what the harness wrote beside the output: an
exit code (Codex's `Exit code: N` / `Process exited with code N` headers and its `{"output", "metadata":
{"exit_code"}}` JSON, Claude Code's `Exit code N`, mini-swe-agent's `<returncode>N</returncode>`, OpenHands'
`[Command finished with exit code N]`) or its message that the tool raised; then a JSON object whose own `error`
field is set. Only where none of these exists are words read, and then only in the shape a failing command
prints them: a Python traceback that ends the output, a line that starts as compilers, git, pytest, make or npm
start a failure, a whole line saying a command or a file is missing. A file that merely mentions "error" is no
failure; a failing command whose output says nothing of it is unknown (`failed` None), never a guess.

Pure and bounded: a text is read by its first HEAD_CHARS and its last TAIL_CHARS (a harness writes its exit
code at one end, a failing command its last words at the other), and JSON is parsed only up to MAX_JSON_CHARS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

HEAD_CHARS = 2_000
TAIL_CHARS = 2_000
MAX_JSON_CHARS = 16_384
HEADER_LINES = 6  # a harness's header (Codex: chunk id, wall time, exit code, token count) fits in these
FOOTER_LINES = 4  # OpenHands' footer: the exit code, the working directory, the interpreter


class Source(StrEnum):
    """Where a verdict comes from, strongest first."""

    IS_ERROR = "is_error"  # the API's own flag on the tool result (Anthropic Messages' `is_error: true`)
    EXIT_CODE = "exit_code"  # an exit code the agent's harness wrote beside the output
    HARNESS_ERROR = "harness_error"  # the agent's harness wrote its own "the tool raised" message instead of output
    RUNNING = "running"  # the harness says the command has not exited yet: no outcome to judge
    JSON_ERROR = "json_error"  # the whole output is a JSON object whose own error field is set
    TRACEBACK = "traceback"  # the output ends in a Python traceback's exception line
    ERROR_LINE = "error_line"  # a line starts as a failing compiler, git, pytest, make or npm starts one
    NOT_FOUND = "not_found"  # a whole line says a command or a file does not exist
    NONE = "none"  # nothing says either way


@dataclass(frozen=True, slots=True)
class Verdict:
    """A tool result's outcome: failed (True), not (False) or unknown (None), why, and its exit code if known."""

    failed: bool | None
    source: Source
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        """Not known to have failed (what the routing rules and metrics count as a success)."""
        return self.failed is not True


UNKNOWN = Verdict(None, Source.NONE)
REPORTED_ERROR = Verdict(True, Source.IS_ERROR)
RUNNING = Verdict(None, Source.RUNNING)
HARNESS_FAILED = Verdict(True, Source.HARNESS_ERROR)

_N = r"(-?\d{1,10})"
# First lines: Codex (`Exit code: N`, unified exec's `Process exited with code N`), Claude Code (`Exit code N`),
# mini-swe-agent (`<returncode>N</returncode>`).
_HEADER = re.compile(rf"(?:Exit code:? {_N}|Process exited with code {_N}|<returncode>{_N}</returncode>)\s*$")
_HEADER_RUNNING = re.compile(r"Process running with (?:session|command) ID \S+\s*$")
# Last lines: OpenHands (`[Command finished with exit code N]`, `[The command completed with exit code N.]`, the
# CodeAct form `[Command <id> finished with exit code N]`) and wrappers that append `Process exited with code N`.
_FOOTER = re.compile(rf"(?:\[(?:The )?[Cc]ommand(?: \S+)? (?:finished|completed) with exit code {_N}\.?\]"
                     rf"|Process exited with code {_N}\.?)\s*$")
# OpenHands' still-running forms (its exit code -1): no new output for a while, or the wait ran out.
_FOOTER_RUNNING = re.compile(r"\[The command (?:has no new output after|timed out after) ")
# What harnesses send back when the tool itself raised: the OpenAI Agents SDK's default failure message, Cline's,
# Claude Code's <tool_use_error> (which also carries is_error).
_HARNESS_ERRORS = ("An error occurred while running the tool.", "The tool execution failed with the following error:",
                   "<tool_use_error>")
_CODEX_METADATA = re.compile(rf'"metadata"\s*:\s*\{{[^{{}}]*"exit_code"\s*:\s*{_N}')

# Failure shapes, each matched at a line's start (so an indented quote inside a file never counts).
_ERROR_LINE = re.compile(
    r"(?:[\w./+-]+:\d+(?::\d+)?: ?)?(?:fatal )?(?:error|fatal)(?:\[[\w-]+\])?: "  # gcc, rustc, git, mypy
    r"|(?:ERROR|FATAL): "  # pip, pytest collection, many CLIs (a script's own `Error: ...` print is no shape)
    r"|npm (?:ERR!|error) "
    r"|make(?:\[\d+\])?: \*\*\* "
    r"|FAILED (?:\S+::|\((?:failures|errors)=)"  # pytest's short summary, unittest's verdict
    r"|=+ (?:.*\b)?\d+ (?:failed|errors?|exceptions?)\b.* =+$"  # pytest's (and sympy's runner's) last line
    r"|=+ no tests ran\b"
    r"|Found \d+ errors?\b"  # ruff, mypy
    r"|sed: -e expression #\d+"
    r"|(?:ba|z)?sh: (?:line \d+: )?(?:syntax error|.*: unbound variable$)"
    r"|\S+: (?:unrecognized|invalid) option\b"
)
# A function tool's whole answer that is its error (`Error: ...`, LangChain's and many tools' convention); later
# lines that start so are a script's own prints far more often than a failure.
_ERROR_ANSWER = re.compile(r"(?:Error|ERROR|Exception)(?: \w+)?: \S")
# A command, a file or a module that is not there, as shells, coreutils and Python say it.
_NOT_FOUND = re.compile(r"\S.*(?::|\]) (?:command not found|not found|No such file or directory)\s*$"
                        r"|\S+: No module named \S+.*$"
                        r"|\S+: .*: Is a directory$"
                        r"|\S+: cannot (?:access|stat|open) .*$")
_TRACEBACK = "Traceback (most recent call last):"
_TRACEBACK_FRAME = re.compile(r'  File "[^"]+", line \d+')
# A traceback's last line: the exception's (dotted) name and message; a name alone must look like an exception's
# unless the traceback's own first line is there too (Django's `django.core.exceptions.EmptyResultSet`).
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::.*)?\s*$")
_DOTTED_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)+[A-Z]\w*(?:: .*)?\s*$")


def judge(text: str, is_error: bool | None = None) -> Verdict:
    """The outcome of one tool result: its text as the agent sends it back, and the API's flag when it has one."""
    if is_error is True:
        return REPORTED_ERROR
    head, tail = text[:HEAD_CHARS], text[-TAIL_CHARS:] if len(text) > HEAD_CHARS else ""
    return _reported(text, head, tail or head) or _shaped(head, tail) or UNKNOWN


def exit_verdict(code: int) -> Verdict:
    return Verdict(code != 0, Source.EXIT_CODE, code)


def _reported(text: str, head: str, tail: str) -> Verdict | None:
    """A verdict the harness wrote: an exit code in the first or the last lines, Codex's JSON metadata, or its
    message that the tool raised."""
    if head.lstrip().startswith(_HARNESS_ERRORS):
        return HARNESS_FAILED
    for line in head.lstrip().split("\n", HEADER_LINES)[:HEADER_LINES]:
        found = _HEADER.match(line.strip())
        if found:
            return exit_verdict(int(next(g for g in found.groups() if g is not None)))
        if _HEADER_RUNNING.match(line.strip()):
            return RUNNING
    for line in tail.rstrip().rsplit("\n", FOOTER_LINES)[-FOOTER_LINES:]:
        found = _FOOTER.match(line.strip())
        if found:
            code = int(next(g for g in found.groups() if g is not None))
            return RUNNING if code == -1 and line.lstrip().startswith("[") else exit_verdict(code)
        if _FOOTER_RUNNING.match(line.strip()):
            return RUNNING
    stripped = head.lstrip()
    if stripped.startswith("{"):
        found = _CODEX_METADATA.search(tail) if stripped.startswith('{"output"') else None
        return exit_verdict(int(found.group(1))) if found else _json_error(text)
    return None


def _json_error(text: str) -> Verdict | None:
    """Failed when the whole output is one JSON object that says so itself: a set `error`, `isError`/`is_error`
    true, `success`/`ok` false (MCP results, HTTP APIs' error bodies)."""
    if len(text) > MAX_JSON_CHARS:
        return None
    try:
        value: Any = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    said = (value.get("error") not in (None, "", False, {}, [])
            or value.get("isError") is True or value.get("is_error") is True
            or value.get("success") is False or value.get("ok") is False)
    return Verdict(True, Source.JSON_ERROR) if said else None


def _shaped(head: str, tail: str) -> Verdict | None:
    """Words in the shape a failing command prints them, where no harness said how it ended."""
    lines = head.split("\n") + (tail.split("\n")[1:] if tail else [])  # the tail's first line may be cut
    last = next((line for line in reversed(lines) if line.strip()), "")
    if _ends_a_traceback(last, lines):
        return Verdict(True, Source.TRACEBACK)
    if _ERROR_ANSWER.match(head.lstrip()):
        return Verdict(True, Source.ERROR_LINE)
    for line in lines:
        if _ERROR_LINE.match(line):
            return Verdict(True, Source.ERROR_LINE)
        if _NOT_FOUND.match(line):
            return Verdict(True, Source.NOT_FOUND)
    return None


def _ends_a_traceback(last: str, lines: list[str]) -> bool:
    if _EXCEPTION_LINE.match(last):
        return any(_TRACEBACK_FRAME.match(line) or line.startswith(_TRACEBACK) for line in lines)
    return _DOTTED_EXCEPTION_LINE.match(last) is not None and any(line.startswith(_TRACEBACK) for line in lines)
