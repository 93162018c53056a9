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
HEADER_CHARS = FOOTER_CHARS = 512  # where those lines are looked for first (a substring test, before any regex)


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
REPORTED_OK = Verdict(False, Source.IS_ERROR)
RUNNING = Verdict(None, Source.RUNNING)
HARNESS_FAILED = Verdict(True, Source.HARNESS_ERROR)

_N = r"(-?\d{1,10})"
# First lines: Codex (`Exit code: N`, unified exec's `Process exited with code N`), Claude Code (`Exit code N`),
# mini-swe-agent (`<returncode>N</returncode>`).
_HEADER = re.compile(rf"(?:Exit code:? {_N}|Process exited with code {_N}|<returncode>{_N}</returncode>)\s*$")
_HEADER_WORDS = ("xit code", "<returncode>", "Process running", "Process exited")
_HEADER_RUNNING = re.compile(r"Process running with (?:session|command) ID \S+\s*$")
# Last lines: OpenHands (`[Command finished with exit code N]`, `[The command completed with exit code N.]`, the
# CodeAct form `[Command <id> finished with exit code N]`) and wrappers that append `Process exited with code N`.
_FOOTER = re.compile(rf"(?:\[(?:The )?[Cc]ommand(?: \S+)? (?:finished|completed) with exit code {_N}\.?\]"
                     rf"|Process exited with code {_N}\.?)\s*$")
# OpenHands' still-running forms (its exit code -1): no new output for a while, or the wait ran out.
_FOOTER_WORDS = ("exit code", "Process exited", "[The command")
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
    r"|=+ (?:.*\b)?\d+ (?:failed|errors?|exceptions?)\b.* =+\s*$"  # pytest's (and sympy's runner's) last line
    r"|=+ no tests ran\b"
    r"|Found \d+ errors?\b"  # ruff, mypy
    r"|sed: -e expression #\d+"
    r"|(?:ba|z)?sh: (?:line \d+: )?(?:syntax error|.*: unbound variable\s*$)"
    r"|\S+: (?:unrecognized|invalid) option\b"
    r"|[\w./-]+(?: [\w./-]+)*: error: "  # argparse's `prog [command]: error: ...`
)
# A function tool's whole answer that is its error (`Error: ...`, LangChain's and many tools' convention); later
# lines that start so are a script's own prints far more often than a failure.
_ERROR_ANSWER = re.compile(r"(?:Error|ERROR|Exception)(?: \w+)?: \S")
# A command, a file or a module that is not there, as shells, coreutils and Python say it: the line's end first
# (a cheap test on every line), then its shape.
_MISSING_ENDS = ("command not found", ": not found", "] not found", "No such file or directory", ": Is a directory")
_MISSING_INSIDE = (": No module named ", ": cannot access ", ": cannot stat ", ": cannot open ")
_NOT_FOUND = re.compile(r"\S+: (?:No module named|cannot (?:access|stat|open)) "
                        r"|\S.*?(?::|\]) (?:command not found|not found|No such file or directory|Is a directory)\s*$")
# Words every shape above holds: a line is matched only where one of them is (str.find scans in C; a regex or a
# Python loop over every line of a long output would cost more than the rest of the request's reading).
_NEEDLES = ("rror: ", "RROR: ", "rror[", "atal: ", "ATAL: ", "atal error", "npm ", ": *** ", "FAILED ", "=====",
            " failed", " exceptions", "Found ", "sed: -e", "sh: ", " option", "not found", "No such file or directory",
            "No module named", "Is a directory", ": cannot ")
MAX_CANDIDATE_LINES = 64  # lines holding a needle that are matched, at most
_TRACEBACK = "Traceback (most recent call last):"
_TRACEBACK_FRAME = '  File "'
# A traceback's last line: the exception's (dotted) name and message; a name alone must look like an exception's
# unless the traceback's own first line is there too (Django's `django.core.exceptions.EmptyResultSet`).
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::.*)?\s*$")
_DOTTED_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)+[A-Z]\w*(?:: .*)?\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def judge(text: str, is_error: bool | None = None) -> Verdict:
    """The outcome of one tool result: its text as the agent sends it back, and the API's flag when it has one."""
    if is_error is True:
        return REPORTED_ERROR
    head, tail = text[:HEAD_CHARS], text[-TAIL_CHARS:] if len(text) > HEAD_CHARS else ""
    reported = _reported(text, head, tail or head)
    if reported is not None:
        return reported
    # A flag said false (Claude Code sends it on every result) outranks words, not an exit code in the text
    return REPORTED_OK if is_error is False else _shaped(head, tail) or UNKNOWN


def exit_verdict(code: int) -> Verdict:
    return Verdict(code != 0, Source.EXIT_CODE, code)


def _reported(text: str, head: str, tail: str) -> Verdict | None:
    """A verdict the harness wrote: an exit code in the first or the last lines, Codex's JSON metadata, or its
    message that the tool raised."""
    start = head.lstrip()
    if start.startswith(_HARNESS_ERRORS):
        return HARNESS_FAILED
    written = _header(start) or _footer(tail.rstrip())
    if written or not start.startswith("{"):
        return written
    found = _CODEX_METADATA.search(tail) if start.startswith('{"output"') else None
    return exit_verdict(int(found.group(1))) if found else _json_error(text)


def _header(start: str) -> Verdict | None:
    if not any(word in start[:HEADER_CHARS] for word in _HEADER_WORDS):
        return None
    for line in start.split("\n", HEADER_LINES)[:HEADER_LINES]:
        found = _HEADER.match(line.strip())
        if found:
            return exit_verdict(int(next(g for g in found.groups() if g is not None)))
        if _HEADER_RUNNING.match(line.strip()):
            return RUNNING
    return None


def _footer(end: str) -> Verdict | None:
    if not any(word in end[-FOOTER_CHARS:] for word in _FOOTER_WORDS):
        return None
    for line in end.rsplit("\n", FOOTER_LINES)[-FOOTER_LINES:]:
        found = _FOOTER.match(line.strip())
        if found:
            code = int(next(g for g in found.groups() if g is not None))
            return RUNNING if code == -1 and line.lstrip().startswith("[") else exit_verdict(code)
        if _FOOTER_RUNNING.match(line.strip()):
            return RUNNING
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
    text = head + "\n" + tail.split("\n", 1)[-1] if tail else head  # the tail's first line may be cut
    if "\x1b[" in text:  # a terminal's colours (pytest's red ERROR lines) are no part of the words
        text, head = _ANSI.sub("", text), _ANSI.sub("", head)
    if _ends_a_traceback(text.rstrip().rsplit("\n", 1)[-1], text):
        return Verdict(True, Source.TRACEBACK)
    if _ERROR_ANSWER.match(head.lstrip()):
        return Verdict(True, Source.ERROR_LINE)
    missing = False
    for line in _candidate_lines(text):
        if _ERROR_LINE.match(line):
            return Verdict(True, Source.ERROR_LINE)
        missing = missing or _missing(line)
    return Verdict(True, Source.NOT_FOUND) if missing else None


def _candidate_lines(text: str) -> list[str]:
    """The unindented lines that hold a needle (an indented line is a file's or a frame's, never a failure's)."""
    starts: set[int] = set()
    for needle in _NEEDLES:
        at = text.find(needle)
        while at != -1 and len(starts) < MAX_CANDIDATE_LINES:
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            end = len(text) if end == -1 else end
            if text[start:start + 1] not in (" ", "\t", ""):
                starts.add(start)
            at = text.find(needle, end)
    lines = []
    for start in sorted(starts):
        end = text.find("\n", start)
        lines.append(text[start:] if end == -1 else text[start:end])
    return lines


def _missing(line: str) -> bool:
    said = line.rstrip().endswith(_MISSING_ENDS) or any(inside in line for inside in _MISSING_INSIDE)
    return said and _NOT_FOUND.match(line) is not None


def _ends_a_traceback(last: str, text: str) -> bool:
    if _EXCEPTION_LINE.match(last):
        return _TRACEBACK in text or _TRACEBACK_FRAME in text
    return _DOTTED_EXCEPTION_LINE.match(last) is not None and _TRACEBACK in text
