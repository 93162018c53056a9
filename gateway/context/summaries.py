"""A conversation's summary in one anchored structure: the summarizer's prompt, and its answer read back.

API-neutral: chat-shaped messages in (`role`, `content`, an assistant's `tool_calls`, a tool's result), the
summary's text out. Each API turns its own items into such messages (Responses: gateway/apis/responses/wire.view;
Anthropic Messages: gateway/apis/messages/wire.view) and the summary back into its own compaction form (Responses:
gateway/apis/responses/compaction.py; Messages: gateway/context/anthropic_compaction.py). Every compaction the
gateway does, whichever API asked, is summarized by this one prompt and read back by this one parser.

    prompt = summary_prompt(messages, max_chars)      # the chat messages the summarizing deployment gets
    prompt = continuation_prompt(messages)            # or the ask as the next turn (old turns: cache-friendly)
    … that deployment's answer text …
    text = written_summary(answer, instructions)      # the six sections, in order (or the client's own form)
    summary_message_text(text)                        # what stands in for the conversation from then on

Why anchored: a summary with the same headings in the same order every time is read back the same way by
the agent at each compaction, and a later compaction folds the earlier summary in section by section instead
of summarizing a summary of a summary in whatever shape the model chose that time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.features import count_tokens, text_of

# The anchored structure: each heading, in this order, in every summary.
SECTIONS = ("Goal", "Decisions", "Files and artifacts", "Errors and fixes", "Pending work", "Next step")
EMPTY = "None recorded."
ENTRY_CHARS = 4_000  # one message or tool result in the transcript at most: its head and its tail
ELIDED = "\n[… {n} characters cut …]\n"
SUMMARY_LEAD = ("[Context summary written by the gateway: the conversation before this point was compacted. "
                "It stands in for everything said and done so far.]\n\n")

INSTRUCTIONS = f"""You compact a coding agent's conversation so that the agent can go on with its task from \
your summary alone: everything before it will be dropped.

Write exactly these six sections, in this order, each under its own heading line `## <name>`:
{chr(10).join(f"## {name}" for name in SECTIONS)}

Under each heading write short bullet points. Keep exact file paths, function names, commands, error \
messages, numbers and identifiers. Under Goal: what the user asked, in their words where they matter. \
Under Decisions: what was chosen and why. Under Files and artifacts: each file read, created or changed \
and what it now holds. Under Errors and fixes: each failure seen and what fixed it (or that nothing has \
yet). Under Pending work: what is left of the task. Under Next step: the one next action. If an earlier \
summary is in the conversation, carry forward everything in it that is still true. Write "{EMPTY}" under \
a heading with nothing to say. No preamble, no closing remarks."""


@dataclass(frozen=True, slots=True)
class Summary:
    """The six sections' bodies, in SECTIONS' order."""

    sections: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(f"## {name}\n{body}" for name, body in zip(SECTIONS, self.sections, strict=True))


def summary_prompt(messages: Sequence[Mapping[str, Any]], max_chars: int,
                   instructions: str | None = None) -> list[dict[str, str]]:
    """The chat messages that ask a deployment for the summary of `messages`, the transcript bounded to
    `max_chars` (the newest entries kept: the oldest ones are the likeliest to be in an earlier summary).
    A client's own `instructions` (Anthropic's compaction takes them) replace INSTRUCTIONS entirely."""
    transcript = _bounded(_entries(messages), max_chars)
    ask = f"<conversation>\n{transcript}\n</conversation>\n\nWrite the summary of the conversation above now."
    return [{"role": "system", "content": instructions or INSTRUCTIONS}, {"role": "user", "content": ask}]


def continuation_prompt(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ask for a summary as the conversation's next turn: `messages` as the deployment last read them, then
    INSTRUCTIONS. Summarizing old turns uses this form: the deployment that served the session holds those
    messages in its prefix cache, so it prefills only the ask (the transcript form prefills the whole span)."""
    ask = f"{INSTRUCTIONS}\n\nWrite the summary of the conversation above now: text only, no tool call."
    return [*messages, {"role": "user", "content": ask}]


def written_summary(answer: str, instructions: str | None = None) -> str:
    """The summary that stands in for the conversation: the answer in the anchored structure, or, written under
    the client's own instructions, as the client asked for it (forcing six headings on it would bury it)."""
    return read_summary(answer).text if instructions is None else answer.strip()


_HEADING = re.compile(r"^[ \t]*(?:#{1,6}[ \t]*)?(?:\*\*)?[ \t]*([A-Za-z][A-Za-z &]*?)[ \t]*(?:\*\*)?[ \t]*:?[ \t]*"
                      r"(?:\*\*)?[ \t]*$", re.MULTILINE)
_KNOWN = {name.lower(): i for i, name in enumerate(SECTIONS)}


def read_summary(text: str) -> Summary:
    """The summarizer's answer in the anchored structure: its sections by their headings (any markdown level,
    bold or not, a colon or not); a section it left out says EMPTY; text before its first heading (a model
    that ignored the structure: all of it) goes under Goal, so nothing it wrote is lost."""
    bodies: list[list[str]] = [[] for _ in SECTIONS]
    current, start = 0, 0
    for found in _HEADING.finditer(text):
        index = _KNOWN.get(found.group(1).strip().lower())
        if index is None:
            continue
        bodies[current].append(text[start:found.start()].strip())
        current, start = index, found.end()
    bodies[current].append(text[start:].strip())
    return Summary(tuple("\n".join(part for part in body if part) or EMPTY for body in bodies))


def summary_message_text(summary_text: str) -> str:
    """The text that stands in for the compacted conversation in what a deployment reads next."""
    return SUMMARY_LEAD + summary_text


def context_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """The conversation's size in tokens as the gateway counts them (cl100k; the deployment's usage is exact)."""
    return sum(count_tokens(_text(message)) for message in messages)


def _entries(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    entries = []
    for message in messages:
        role = message.get("role")
        text = _cut(_text(message))
        if text:
            failed = " (error)" if message.get("is_error") is True else ""  # a tool result the tool reported failed
            entries.append(f"[{role if isinstance(role, str) else 'unknown'}{failed}]\n{text}")
    return entries


def _text(message: Mapping[str, Any]) -> str:
    """A message's text, its tool calls written as `name(arguments)` after it."""
    parts = [text_of(message.get("content"))]
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            parts.append(f"calls {function.get('name')}({function.get('arguments') or ''})")
    return "\n".join(part for part in parts if part)


def _cut(text: str) -> str:
    if len(text) <= ENTRY_CHARS:
        return text
    half = ENTRY_CHARS // 2
    return text[:half] + ELIDED.format(n=len(text) - 2 * half) + text[-half:]


def _bounded(entries: list[str], max_chars: int) -> str:
    kept: list[str] = []
    size = 0
    for entry in reversed(entries):
        if size + len(entry) > max_chars and kept:
            kept.append(f"[… {len(entries) - len(kept)} earlier entries left out …]")
            break
        kept.append(entry[-max_chars:])
        size += len(entry) + 2
    return "\n\n".join(reversed(kept))
