"""Where a request stands in its agent loop, read from the conversation it carries: the step number, a new
user turn or a tool-result continuation, a tool result that reports an error, a tool call repeated.

Pure and bounded (the last MAX_MESSAGES messages, each tool result judged within gateway/agents/tool_outcomes.py's
bounds, arguments compared as JSON up to MAX_CANONICAL_CHARS); any JSON shape is read without raising: what is not
the shape the OpenAI API gives a field is ignored. The policy's trajectory conditions (`turn`, `step`, `tool_error`,
`repeated_calls`) read it, and so does the trajectory record (agents/trajectory.py).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.agents.tool_outcomes import Verdict, judge
from gateway.apis.recurring import Conversation, resume

MAX_MESSAGES = 200
# Longer arguments are compared as written: re-encoding megabytes per call would cost more than it tells.
MAX_CANONICAL_CHARS = 65_536
# JSON bodies hold dicts: isinstance tests dict first, and only anything else reaches the Mapping ABC's slow check.
_MAPPING = (dict, Mapping)
_ASSISTANTS = "steps.assistants"  # a conversation's assistant turns, noted in the parse memory


@dataclass(frozen=True, slots=True)
class AgentStep:
    step: int  # this call's place in the loop: the assistant turns before it, plus one
    turn: str  # "user": a new user turn (planning); "tool_result": tool results fed back; "other"
    tool_error: bool  # a tool result fed back by this call failed, by what the tool reports (tool_outcomes.judge)
    repeated_calls: int  # how many times in a row the latest tool call (name and arguments) was made
    # The verdicts of the tool results fed back, newest first, as far as `tool_error` read them: the step's record
    # takes them rather than judging each result again (trajectory.tool_results).
    verdicts: tuple[Verdict, ...] = field(default=(), compare=False, repr=False)

    def as_record(self) -> dict[str, Any]:
        """What the request log keeps of the step (the rules' inputs; `policy simulate` reads them back)."""
        return {"step": self.step, "turn": self.turn, "tool_error": self.tool_error,
                "repeated_calls": self.repeated_calls}


def read_step(body: Mapping[str, Any], conversation: Conversation | None = None) -> AgentStep | None:
    """The agent step of a chat body, or None when it carries no messages. `conversation`: the parse memory's of
    the messages, where their assistant turns are counted (a step that continues one counts those it adds)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    recent = [m for m in messages[-MAX_MESSAGES:] if isinstance(m, _MAPPING)]
    if not recent:
        return None
    failed, verdicts = _tool_error(recent)
    return AgentStep(_assistant_turns(messages, recent, conversation) + 1, _turn(recent), failed, _repeats(recent),
                     verdicts)


def _assistant_turns(messages: list[Any], recent: list[Mapping[str, Any]], conversation: Conversation | None) -> int:
    """The assistant turns among the recent messages: all of them while there are at most MAX_MESSAGES, counted
    on from the step before's count where the parse memory noted it."""
    if len(messages) > MAX_MESSAGES:
        return _assistants(recent)
    earlier, start, noting = resume(conversation, messages, _ASSISTANTS)
    turns = (earlier or 0) + _assistants(messages[start:])
    if noting is not None:
        noting[_ASSISTANTS] = turns
    return turns


def _assistants(messages: list[Any]) -> int:
    return sum(1 for m in messages if isinstance(m, _MAPPING) and m.get("role") == "assistant")


def _turn(messages: Sequence[Mapping[str, Any]]) -> str:
    role = messages[-1].get("role")
    if role == "tool" or role == "function":
        return "tool_result"
    return "user" if role == "user" else "other"


def _tool_error(messages: Sequence[Mapping[str, Any]]) -> tuple[bool, tuple[Verdict, ...]]:
    """Whether a tool result after the last assistant turn (the results this call feeds back) failed, and the
    verdicts read on the way (newest first; only while the messages are plain dicts, as the record reads them)."""
    found: list[Verdict] = []
    shared = True
    for message in reversed(messages):
        if message.get("role") not in ("tool", "function"):
            break
        # Anthropic's tool_result blocks say so themselves (`is_error`, kept on the chat view's tool message)
        verdict = judge(_text(message.get("content")), message.get("is_error"))
        shared = shared and type(message) is dict
        if shared:
            found.append(verdict)
        if verdict.failed is True:
            return True, tuple(found)
    return False, tuple(found)


def _repeats(messages: Sequence[Mapping[str, Any]]) -> int:
    """The run length of the latest tool call at the end of the trajectory (0: the agent called no tool).

    Walked back from the latest call, each one made canonical only when its name matches and its arguments
    differ as written, and the messages read only as far back as the run goes: an agent's history of dozens of
    calls costs two or three JSON round trips and a few messages' calls, not one each.
    """
    calls = _calls_backwards(messages)
    found = next(calls, None)
    if found is None:
        return 0
    name, arguments = found
    latest: str | None = None  # the latest call's canonical arguments, once a call needs them
    run = 0
    for other_name, other_arguments in itertools.chain((found,), calls):
        if other_name != name:
            break
        written_alike = isinstance(arguments, str) and other_arguments == arguments  # a dict equal by == may not be:
        if not written_alike:  # 1, 1.0 and True are equal values that JSON writes apart
            latest = canonical(arguments) if latest is None else latest
            if canonical(other_arguments) != latest:
                break
        run += 1
    return run


def _calls_backwards(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The assistants' tool calls, latest first, read only as far as the caller walks back."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            yield from reversed(_calls(message))


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """An assistant message's tool calls as (name, arguments as sent)."""
    calls = message.get("tool_calls")
    found = []
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, _MAPPING) else None
        if isinstance(function, _MAPPING):
            found.append((str(function.get("name")), function.get("arguments")))
    return found


def canonical(arguments: Any) -> str:
    """Tool-call arguments as a comparable string: the same JSON with other spacing or key order is the same
    call. Arguments that do not parse, nest too deeply for the parser, or are too long to re-encode are
    compared as written (stripped)."""
    if isinstance(arguments, str):
        if len(arguments) > MAX_CANONICAL_CHARS:
            return arguments.strip()
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # the C parser raises RecursionError past ~1,000 levels
            return arguments.strip()
    else:
        parsed = arguments
    try:
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"), default=str)
    except (ValueError, TypeError, RecursionError):  # keys of mixed types, nesting too deep to re-encode
        return json.dumps(str(type(arguments).__name__))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, _MAPPING))  # parts keep their lines
    return "" if content is None else str(content)
