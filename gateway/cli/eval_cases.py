"""The evaluation set's YAML (`agent-gateway eval --cases FILE`): cases of a task prompt, the tools the agent
may call (each with the output it gets back) and assertions on the final answer and the tool calls; and
the check of one run against its case.

    cases:
      - id: weather-paris                 # unique; the outcome's `task` label
        prompt: What is the weather in Paris? Use the tool.
        system: You are a careful agent.  # optional
        tags: [tools]                     # optional; the report breaks pass rates down by tag
        max_steps: 4                      # calls to the model at most (default 6)
        max_tokens: 256                   # per call (default 256); temperature defaults to 0
        tools:
          - name: get_weather
            description: the weather in a city
            parameters: {type: object, properties: {city: {type: string}}, required: [city]}
            result: 18 C and sunny         # what the agent sends back when the model calls it
        expect:                            # every assertion given must hold
          tool_called: [get_weather]       # each of these tools was called
          tool_args: {get_weather: {city: Paris}}   # some call of the tool had these arguments
          no_tool_calls: false             # true: the model must answer without calling a tool
          answer_contains: ["18"]          # case-insensitive substrings of the final answer
          answer_matches: "\\b18\\b"         # a regular expression (Python) the final answer matches
          answer_equals: null              # the final answer exactly (trimmed)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gateway.frozen import Frozen


class Tool(Frozen):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    result: str = Field(default="ok", description="the tool's output the agent sends back")

    def spec(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class Expect(Frozen):
    answer_contains: tuple[str, ...] = ()
    answer_matches: str | None = None
    answer_equals: str | None = None
    tool_called: tuple[str, ...] = ()
    tool_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    no_tool_calls: bool = False

    @field_validator("answer_matches")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"answer_matches {value!r} is not a regular expression: {exc}") from None
        return value


class Case(Frozen):
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    prompt: str = Field(min_length=1)
    system: str | None = None
    tags: tuple[str, ...] = ()
    max_steps: int = Field(default=6, ge=1, le=50)
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0, le=2)
    tools: tuple[Tool, ...] = ()
    expect: Expect = Expect()

    @model_validator(mode="after")
    def _coherent(self) -> Case:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: a name is given twice ({names})")
        for name in (*self.expect.tool_called, *self.expect.tool_args):
            if name not in names:
                raise ValueError(f"expect names the tool {name!r}, which the case does not offer ({names})")
        return self

    def messages(self) -> list[dict[str, Any]]:
        first = [{"role": "system", "content": self.system}] if self.system else []
        return [*first, {"role": "user", "content": self.prompt}]


class CaseFile(Frozen):
    cases: tuple[Case, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> CaseFile:
        seen: set[str] = set()
        for case in self.cases:
            if case.id in seen:
                raise ValueError(f"case id {case.id!r} is given twice")
            seen.add(case.id)
        return self


class CaseError(ValueError):
    """A case file that cannot be used: one line naming the file, the field and the problem."""


def load(path: str) -> tuple[Case, ...]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CaseError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise CaseError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    try:
        return CaseFile.model_validate(data).cases
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise CaseError(f"{path}: {where}: {first['msg'].removeprefix('Value error, ')}") from None


@dataclass(slots=True)
class Run:
    """What one agent run did: its final answer (None: it never gave one) and the tool calls it made."""

    answer: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)  # (tool name, parsed arguments)


def check(case: Case, run: Run) -> tuple[bool, str]:
    """Whether the run passes its case, and the first assertion it fails (or what it did)."""
    expect = case.expect
    called = [name for name, _ in run.calls]
    if run.answer is None:
        return False, f"no final answer within {case.max_steps} steps"
    for name in expect.tool_called:
        if name not in called:
            return False, f"never called {name}"
    for name, wanted in expect.tool_args.items():
        if not any(n == name and _holds(args, wanted) for n, args in run.calls):
            return False, f"no call of {name} with {json.dumps(wanted)}"
    if expect.no_tool_calls and called:
        return False, f"called {', '.join(called)} but should have answered directly"
    return _check_answer(expect, run.answer.strip())


def _check_answer(expect: Expect, answer: str) -> tuple[bool, str]:
    shown = answer[:80]
    for part in expect.answer_contains:
        if part.lower() not in answer.lower():
            return False, f"the answer lacks {part!r}: {shown!r}"
    if expect.answer_matches is not None and not re.search(expect.answer_matches, answer):
        return False, f"the answer does not match {expect.answer_matches!r}: {shown!r}"
    if expect.answer_equals is not None and answer != expect.answer_equals.strip():
        return False, f"the answer is not {expect.answer_equals!r}: {shown!r}"
    return True, "passed"


def _holds(arguments: Any, wanted: Mapping[str, Any]) -> bool:
    return isinstance(arguments, Mapping) and all(arguments.get(k) == v for k, v in wanted.items())


def parse_arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw


def tags_of(cases: Sequence[Case]) -> list[str]:
    return sorted({tag for case in cases for tag in case.tags})
