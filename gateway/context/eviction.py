"""Old turns summarized: a conversation's oldest turns give way to one anchored summary, sticky and in batches
(pure, over each agent API's own list of messages or items).

    turns = read_turns(shape, body)          each entry's tokens, where a turn starts, a digest through each
    cut = boundary(turns, rule)              the summarized span is turns.head..cut (cut == head: none)
    body = summarized(shape, body, turns.head, cut, text)     that span replaced by the summary's message

The head (the system prompt and the task: the leading system messages and the first user message) is never
summarized. The cut is a function of the entries alone: the conversation is replayed entry by entry, and once
what follows the head (the summary, estimated at `summary_tokens`, and the entries after the cut) grows past
`over_tokens`, the cut jumps to the turn start that keeps at most `keep_tokens` of the newest entries (at least
the newest turn). An agent's next step re-sends the same entries plus new ones, so the cut never moves back and
moves only in large steps: between two moves the summary is the same text and the prompt's prefix stays cached.
The span's digest names its summary: the same entries, the same summary, whichever step or replica asks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from gateway.context.counting import Count, value_text
from gateway.features import estimate_tokens

_ENCODE = msgspec.json.Encoder().encode  # compact JSON, ~5x json.dumps: every entry is encoded at every step
SUMMARIZE = "summarize_old_turns"  # the name of the rule in the policy, the trail and the metrics
LEAD = "[Context summary written by the gateway: the {n} oldest entries of this conversation after the task " \
       "({tokens} tokens) were summarized; they are kept whole as {ref} (GET /v1/context/{ref}).]\n\n"


@dataclass(frozen=True, slots=True)
class EvictRule:
    """When old turns are summarized: once what follows the head is over `over_tokens`, all but the newest
    `keep_tokens` of it (whole turns) give way to a summary of at most `summary_tokens`."""

    over_tokens: int = 16_000
    keep_tokens: int = 4_000
    summary_tokens: int = 1_024


@dataclass(frozen=True, slots=True)
class Turns:
    """A conversation as eviction reads it: per entry (message or item), oldest first."""

    head: int  # entries before this index are never summarized
    tokens: tuple[int, ...]
    starts: tuple[bool, ...]  # a turn starts at this entry: a span may end just before it
    digests: tuple[str, ...]  # digests[i] hashes entries 0..i
    texts: tuple[str, ...]  # each entry as the digest and the count read it (compact JSON)

    def span_key(self, cut: int) -> str:
        """What names the summary of entries before `cut`: the digest through the span's last entry."""
        return self.digests[cut - 1]

    def span_tokens(self, cut: int) -> int:
        return sum(self.tokens[self.head:cut])


def boundary(turns: Turns, rule: EvictRule) -> int:
    """Where the summarized span ends (turns.head: nothing summarized): the entries replayed one by one, the cut
    jumping forward whenever what follows the head outgrows `over_tokens`."""
    head, tokens, starts = turns.head, turns.tokens, turns.starts
    cut, live = head, 0
    for i in range(head, len(tokens)):
        live += tokens[i]
        if live + (rule.summary_tokens if cut > head else 0) <= rule.over_tokens:
            continue
        moved = _kept_from(tokens, starts, cut, i, rule.keep_tokens)
        if moved > cut:
            cut, live = moved, sum(tokens[moved:i + 1])
    return cut


def _kept_from(tokens: Sequence[int], starts: Sequence[bool], cut: int, last: int, keep_tokens: int) -> int:
    """The earliest turn start after `cut` from which entries through `last` hold at most `keep_tokens` (else the
    newest turn start: at least one turn is kept whole); `cut` when no turn starts after it."""
    kept, best = 0, cut
    for j in range(last, cut, -1):
        kept += tokens[j]
        if starts[j]:
            if kept > keep_tokens and best > cut:
                break
            best = j
            if kept > keep_tokens:
                break
    return best


class TurnShape(Protocol):
    """One API's conversation: its list of entries, where turns start, and the summary's entry."""

    key: str  # the body's list: "messages" or "input"

    def head(self, entries: Sequence[Any]) -> int: ...

    def starts_turn(self, entries: Sequence[Any], i: int) -> bool: ...

    def summary_entry(self, text: str) -> dict[str, Any]: ...


def read_turns(shape: TurnShape, body: Mapping[str, Any], count: Count = estimate_tokens) -> Turns | None:
    """The body's conversation as eviction reads it (None: no list of entries). Each entry is counted by its
    compact JSON's bytes (4 a token, the gateway's estimate for long texts): a step re-reads every entry, and an
    exact count of a 100-200 KB conversation would cost each request far more than this (docs/performance.md,
    'Why the code is shaped so'; a function of the entry alone all the same, so the span is as sticky)."""
    entries = body.get(shape.key)
    if not isinstance(entries, list) or not entries:
        return None
    texts = tuple(map(_entry_text, entries))
    running = hashlib.sha256()
    digests = []
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        running.update(len(data).to_bytes(8, "little"))
        running.update(data)
        digests.append(running.copy().hexdigest())
    starts = tuple(shape.starts_turn(entries, i) for i in range(len(entries)))
    return Turns(shape.head(entries), tuple(map(count, texts)), starts, tuple(digests), texts)


def _entry_text(entry: Any) -> str:
    """An entry as compact JSON (a lone surrogate, which JSON's escapes allow, through the slower encoder)."""
    try:
        return _ENCODE(entry).decode()
    except (UnicodeEncodeError, TypeError):
        return value_text(entry)


def summarized(shape: TurnShape, body: Mapping[str, Any], head: int, cut: int, text: str) -> dict[str, Any]:
    """The body with entries head..cut replaced by the summary's entry."""
    entries = body[shape.key]
    return {**body, shape.key: [*entries[:head], shape.summary_entry(text), *entries[cut:]]}


def summary_text(summary: str, entries: int, tokens: int, ref: str) -> str:
    """The summary's entry as the deployment reads it: what it stands for, where the originals are, the summary."""
    return LEAD.format(n=entries, tokens=tokens, ref=ref) + summary


def span_document(turns: Turns, cut: int) -> bytes:
    """The summarized entries as kept in the object store: a JSON array of them, as the client sent them."""
    return ("[" + ",".join(turns.texts[turns.head:cut]) + "]").encode("utf-8", "surrogatepass")


def _role(entry: Any) -> Any:
    return entry.get("role") if isinstance(entry, Mapping) else None


def _leading_system_then_user(entries: Sequence[Any], system: frozenset[str]) -> int:
    i = 0
    while i < len(entries) and _role(entries[i]) in system:
        i += 1
    return i + 1 if i < len(entries) and _role(entries[i]) == "user" else i


class ChatTurns:
    """Chat Completions: a turn starts at a user or assistant message (never between a call and its results)."""

    key = "messages"
    SYSTEM = frozenset({"system", "developer"})

    def head(self, entries: Sequence[Any]) -> int:
        return _leading_system_then_user(entries, self.SYSTEM)

    def starts_turn(self, entries: Sequence[Any], i: int) -> bool:
        return bool(_role(entries[i]) in ("user", "assistant"))

    def summary_entry(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}


class ResponsesTurns:
    """Responses: a turn starts at an item that is no tool output and follows no call awaiting its output."""

    key = "input"
    SYSTEM = frozenset({"system", "developer"})
    CALLS = frozenset({"function_call", "custom_tool_call", "local_shell_call", "reasoning"})
    OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output", "local_shell_call_output"})

    def head(self, entries: Sequence[Any]) -> int:
        return _leading_system_then_user(entries, self.SYSTEM)

    def starts_turn(self, entries: Sequence[Any], i: int) -> bool:
        if _kind(entries[i]) in self.OUTPUTS:
            return False
        return i == 0 or _kind(entries[i - 1]) not in self.CALLS

    def summary_entry(self, text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


class MessagesTurns:
    """Anthropic Messages: a turn starts at an assistant message (a user message may hold the tool results of
    the assistant's before it)."""

    key = "messages"

    def head(self, entries: Sequence[Any]) -> int:
        return 1 if entries and _role(entries[0]) == "user" else 0

    def starts_turn(self, entries: Sequence[Any], i: int) -> bool:
        return bool(_role(entries[i]) == "assistant")

    def summary_entry(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text}]}


def _kind(entry: Any) -> Any:
    return entry.get("type", "message") if isinstance(entry, Mapping) else None


CHAT = ChatTurns()
RESPONSES = ResponsesTurns()
MESSAGES = MessagesTurns()
