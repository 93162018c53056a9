"""Anthropic's context edits done by the gateway on a Messages body, before a deployment (vLLM) reads it.

    edits = read_edits(body)                     (anthropic_config.py: a 400 for a bad edit)
    managed = manage(body, edits)                 the body the deployment gets and what each edit cleared

The client keeps its full history and sends it each turn; the same history always edits the same way, so the
edited prompt's prefix stays cached turn after turn until the next clearing moves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.context import anthropic_compaction as compaction
from gateway.context.anthropic_config import CLEAR_THINKING, COMPACT, FIELD, ClearThinking, ClearToolUses, Compact, Edit
from gateway.context.counting import Count, block_tokens, content_tokens, input_tokens, text_tokens

# What a cleared tool result reads as, so the model knows a result was there and was taken out.
CLEARED_TOOL_RESULT = "[Tool result cleared by context management to save context]"
THINKING_BLOCKS = ("thinking", "redacted_thinking")
# What each edit counts as cleared (a compaction, which Anthropic reports by its block, the messages it replaced).
_UNITS = {CLEAR_THINKING: "cleared_thinking_turns", COMPACT: "cleared_messages"}


@dataclass(frozen=True, slots=True)
class Applied:
    """One edit that changed the prompt: what it cleared (tool uses, thinking turns, or messages summarized)
    and the input tokens that freed."""

    type: str
    cleared: int
    cleared_input_tokens: int

    def as_anthropic(self) -> dict[str, Any]:
        """As Anthropic reports it in `context_management.applied_edits` (compaction shows as its block instead)."""
        unit = _UNITS.get(self.type, "cleared_tool_uses")
        return {"type": self.type, unit: self.cleared, "cleared_input_tokens": self.cleared_input_tokens}


@dataclass(slots=True)
class Managed:
    """A Messages body after its context edits: what the deployment reads, and what was done to get it."""

    body: dict[str, Any]
    applied: list[Applied] = field(default_factory=list)
    # The prompt's tokens before and after the edits, counted only when a trigger reads them (a walk of the
    # whole conversation, costly for one as long as Claude Code's, which clears thinking on every turn without one)
    tokens_before: int | None = None
    tokens_after: int | None = None
    compaction: Compact | None = None  # due now: the runtime summarizes `body` and answers with the summary
    summary: str | None = None  # this call's summary, once the runtime has it: the answer carries it back
    took_in_summary: bool = False  # the client sent an earlier compaction back: the prompt starts from it

    def clearings(self) -> list[Applied]:
        """The edits that cleared part of the prompt (a compaction replaced all of it: it is reported apart)."""
        return [a for a in self.applied if a.type != COMPACT]

    def reported_edits(self) -> list[dict[str, Any]]:
        return [a.as_anthropic() for a in self.clearings()]

    def without_body(self) -> Managed:
        """The record alone, to be remembered past the request (a body can be megabytes)."""
        return replace(self, body={}, applied=list(self.applied))

    def describe(self) -> dict[str, Any]:
        """For the decision trail: every edit applied (compaction too), the prompt's tokens before and after."""
        return {"applied_edits": [a.as_anthropic() for a in self.applied],
                "tokens_before": self.tokens_before, "tokens_after": self.tokens_after,
                "compaction_due": self.compaction is not None and self.summary is None,
                "took_in_summary": self.took_in_summary}


def manage(body: Mapping[str, Any], edits: tuple[Edit, ...], count: Count = text_tokens) -> Managed:
    """The body as the deployment reads it: earlier compactions taken in (when compaction is on: only a client
    that asks for it gets compaction blocks to send back), each edit applied in the order given,
    `context_management` gone. The counts are taken only when an edit needs them."""
    out = {k: v for k, v in body.items() if k != FIELD}
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    earlier = None
    if any(isinstance(edit, Compact) for edit in edits):
        messages, earlier = compaction.take_in(messages)
    out["messages"] = messages
    managed = Managed(out, took_in_summary=earlier is not None)
    if not edits:
        return managed
    if any(_reads_tokens(edit) for edit in edits):
        managed.tokens_before = input_tokens(out, count)
    tokens = managed.tokens_before or 0  # as the edits so far left the prompt
    for edit in edits:
        if isinstance(edit, Compact):
            if tokens > edit.trigger:
                managed.compaction = edit
            continue
        messages, applied = (clear_tool_uses(messages, edit, tokens, count)
                             if isinstance(edit, ClearToolUses) else clear_thinking(messages, edit, count))
        if applied is not None:
            managed.applied.append(applied)
            tokens -= applied.cleared_input_tokens
    out["messages"] = messages
    managed.tokens_after = None if managed.tokens_before is None else tokens
    return managed


def _reads_tokens(edit: Edit) -> bool:
    return isinstance(edit, Compact) or (isinstance(edit, ClearToolUses) and edit.trigger_type == "input_tokens")


def clear_tool_uses(messages: list[Any], edit: ClearToolUses, prompt_tokens: int,
                    count: Count = text_tokens) -> tuple[list[Any], Applied | None]:
    """Past the trigger, every tool use but the newest `keep` (and the excluded tools') has its result replaced
    by a placeholder (and its input emptied, with clear_tool_inputs); nothing at all when that frees fewer
    than `clear_at_least` tokens."""
    uses = _tool_uses(messages)
    reached = len(uses) if edit.trigger_type == "tool_uses" else prompt_tokens
    if reached <= edit.trigger:
        return messages, None
    older = uses[:len(uses) - edit.keep] if edit.keep else uses
    results = _tool_results(messages)
    placeholder = count(CLEARED_TOOL_RESULT)
    changes: dict[tuple[int, int], dict[str, Any]] = {}
    cleared, freed = 0, 0
    for at, use in older:
        name = use.get("name")
        if name in edit.exclude_tools:
            continue
        touched = False
        result_at = results.get(use.get("id"))
        if result_at is not None:
            result = _block(messages, result_at)
            freed += content_tokens(result.get("content"), count) - placeholder
            changes[result_at] = {**result, "content": CLEARED_TOOL_RESULT}
            touched = True
        if _clears_input(edit, name) and use.get("input"):
            freed += block_tokens(use, count) - block_tokens({**use, "input": {}}, count)
            changes[at] = {**use, "input": {}}
            touched = True
        cleared += touched
    if not cleared or freed < edit.clear_at_least:
        return messages, None
    return _replaced(messages, changes), Applied(edit.type, cleared, max(freed, 0))


def clear_thinking(messages: list[Any], edit: ClearThinking,
                   count: Count = text_tokens) -> tuple[list[Any], Applied | None]:
    """Thinking blocks are taken out of every assistant turn but the newest `keep` turns that have them."""
    if edit.keep is None:
        return messages, None
    turns = [i for i, m in enumerate(messages) if _role(m) == "assistant" and any(
        isinstance(b, Mapping) and b.get("type") in THINKING_BLOCKS for b in _blocks(m))]
    older = turns[:len(turns) - edit.keep] if edit.keep else turns
    if not older:
        return messages, None
    out, freed = list(messages), 0
    for i in older:
        kept: list[Any] = []
        thinking: list[Any] = []
        for b in _blocks(messages[i]):
            (thinking if isinstance(b, Mapping) and b.get("type") in THINKING_BLOCKS else kept).append(b)
        freed += sum(block_tokens(b, count) for b in thinking)
        out[i] = {**messages[i], "content": kept}
    return out, Applied(edit.type, len(older), freed)


def _tool_uses(messages: list[Any]) -> list[tuple[tuple[int, int], Mapping[str, Any]]]:
    """Every tool_use block of the assistant's turns, oldest first, with where it is."""
    return [((i, j), b) for i, m in enumerate(messages) if _role(m) == "assistant"
            for j, b in enumerate(_blocks(m)) if isinstance(b, Mapping) and b.get("type") == "tool_use"]


def _tool_results(messages: list[Any]) -> dict[Any, tuple[int, int]]:
    """Where each tool use's result is, by its tool_use_id."""
    return {b.get("tool_use_id"): (i, j) for i, m in enumerate(messages) if _role(m) == "user"
            for j, b in enumerate(_blocks(m)) if isinstance(b, Mapping) and b.get("type") == "tool_result"}


def _clears_input(edit: ClearToolUses, name: Any) -> bool:
    return edit.clear_inputs if isinstance(edit.clear_inputs, bool) else name in edit.clear_inputs


def _replaced(messages: list[Any], changes: dict[tuple[int, int], dict[str, Any]]) -> list[Any]:
    """The messages with the changed blocks put in; only the messages they touch are copied."""
    out = list(messages)
    for (i, j), block in changes.items():
        if out[i] is messages[i]:
            out[i] = {**messages[i], "content": list(_blocks(messages[i]))}
        out[i]["content"][j] = block
    return out


def _block(messages: list[Any], at: tuple[int, int]) -> Mapping[str, Any]:
    found: Mapping[str, Any] = messages[at[0]]["content"][at[1]]
    return found


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, Mapping) else None
    return content if isinstance(content, list) else []
