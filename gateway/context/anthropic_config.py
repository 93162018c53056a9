"""Anthropic's `context_management` request field read into frozen edits, checked as Anthropic checks it.

A field of the wrong type, an unknown edit type or field, a negative count: a 400 that names the field and the
value (Anthropic's own answer to the same request). Defaults are Anthropic's documented ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest

FIELD = "context_management"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
COMPACT = "compact_20260112"
EDIT_TYPES = (CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT)
# Anthropic's defaults and floor: clearing starts past 100k input tokens and keeps the 3 newest tool uses;
# thinking is kept for the newest assistant turn; compaction starts past 150k and never below 50k.
DEFAULT_TOOL_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
DEFAULT_COMPACT_TRIGGER_TOKENS = 150_000
MIN_COMPACT_TRIGGER_TOKENS = 50_000


@dataclass(frozen=True, slots=True)
class ClearToolUses:
    """clear_tool_uses_20250919: past the trigger, the oldest tool results (and inputs) give way to a placeholder."""

    trigger_type: str  # input_tokens | tool_uses
    trigger: int  # the edit applies once the prompt's count of that kind exceeds this
    keep: int  # the newest tool uses left untouched
    clear_at_least: int  # input tokens the edit must free, else it is not applied at all
    exclude_tools: frozenset[str]  # tools whose uses and results are never cleared
    clear_inputs: bool | frozenset[str]  # clear the tool_use inputs too: all (True), none, or of these tools
    type: str = CLEAR_TOOL_USES


@dataclass(frozen=True, slots=True)
class ClearThinking:
    """clear_thinking_20251015: thinking blocks are kept for the newest `keep` assistant turns only."""

    keep: int | None  # None: keep all (the prompt's cache survives)
    type: str = CLEAR_THINKING


@dataclass(frozen=True, slots=True)
class Compact:
    """compact_20260112: past the trigger, the conversation is replaced by a summary (a `compaction` block)."""

    trigger: int
    instructions: str | None  # replaces the default summary prompt entirely
    pause_after: bool  # answer the compaction block alone, stop_reason "compaction"
    type: str = COMPACT


Edit = ClearToolUses | ClearThinking | Compact


def read_edits(body: Mapping[str, Any]) -> tuple[Edit, ...]:
    """The edits a request asks for, in its order (none when it has no `context_management`)."""
    config = body.get(FIELD)
    if config is None:
        return ()
    _fields(config, FIELD, {"edits"})
    found = config.get("edits")
    if found is None:
        return ()
    if not isinstance(found, list):
        raise _bad(f"{FIELD}.edits", found, "must be a list of edits")
    edits = tuple(_edit(item, f"{FIELD}.edits[{i}]") for i, item in enumerate(found))
    kinds = [edit.type for edit in edits]
    for i, kind in enumerate(kinds):
        if kind in kinds[:i]:
            raise _bad(f"{FIELD}.edits[{i}].type", kind, "appears twice; each edit type may be given once")
    if CLEAR_THINKING in kinds and kinds[0] != CLEAR_THINKING:
        raise _bad(f"{FIELD}.edits[{kinds.index(CLEAR_THINKING)}].type", CLEAR_THINKING,
                   "must be the first edit when other edits are given")
    return edits


def _edit(item: Any, where: str) -> Edit:
    if not isinstance(item, Mapping):
        raise _bad(where, item, "must be an object with a 'type'")
    kind = item.get("type")
    if kind == CLEAR_TOOL_USES:
        return _clear_tool_uses(item, where)
    if kind == CLEAR_THINKING:
        _fields(item, where, {"type", "keep"})
        return ClearThinking(_thinking_keep(item.get("keep", _unset), f"{where}.keep"))
    if kind == COMPACT:
        return _compact(item, where)
    raise _bad(f"{where}.type", kind, f"is not a known edit type; use one of {', '.join(EDIT_TYPES)}")


def _clear_tool_uses(item: Mapping[str, Any], where: str) -> ClearToolUses:
    _fields(item, where, {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"})
    trigger_type, trigger = _amount(item.get("trigger"), f"{where}.trigger", ("input_tokens", "tool_uses"),
                                    ("input_tokens", DEFAULT_TOOL_TRIGGER_TOKENS), minimum=1)
    _, keep = _amount(item.get("keep"), f"{where}.keep", ("tool_uses",), ("tool_uses", DEFAULT_KEEP_TOOL_USES))
    _, at_least = _amount(item.get("clear_at_least"), f"{where}.clear_at_least", ("input_tokens",),
                          ("input_tokens", 0))
    return ClearToolUses(trigger_type, trigger, keep, at_least, _names(item.get("exclude_tools"),
                         f"{where}.exclude_tools"), _clear_inputs(item.get("clear_tool_inputs"), where))


def _compact(item: Mapping[str, Any], where: str) -> Compact:
    _fields(item, where, {"type", "trigger", "instructions", "pause_after_compaction"})
    _, trigger = _amount(item.get("trigger"), f"{where}.trigger", ("input_tokens",),
                         ("input_tokens", DEFAULT_COMPACT_TRIGGER_TOKENS), minimum=MIN_COMPACT_TRIGGER_TOKENS)
    instructions = item.get("instructions")
    if instructions is not None and (not isinstance(instructions, str) or not instructions.strip()):
        raise _bad(f"{where}.instructions", instructions, "must be a non-empty string")
    pause = item.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise _bad(f"{where}.pause_after_compaction", pause, "must be a boolean")
    return Compact(trigger, instructions, pause)


class _Unset:
    """`keep` left out (which is not the same as `keep: null`)."""


_unset = _Unset()


def _thinking_keep(keep: Any, where: str) -> int | None:
    if isinstance(keep, _Unset):
        return DEFAULT_KEEP_THINKING_TURNS
    if keep == "all" or (isinstance(keep, Mapping) and keep.get("type") == "all" and len(keep) == 1):
        return None
    _, turns = _amount(keep, where, ("thinking_turns",), None)
    return turns


def _amount(value: Any, where: str, kinds: tuple[str, ...], default: tuple[str, int] | None,
            minimum: int = 0) -> tuple[str, int]:
    """A `{type, value}` object of one of `kinds`, its value a whole number of at least `minimum`."""
    if value is None and default is not None:
        return default
    shape = f"{{\"type\": {' | '.join(repr(k) for k in kinds)}, \"value\": <integer>}}"
    if not isinstance(value, Mapping):
        raise _bad(where, value, f"must be an object {shape}")
    if value.get("type") not in kinds:
        raise _bad(f"{where}.type", value.get("type"), f"is not one of {', '.join(repr(k) for k in kinds)}")
    _fields(value, where, {"type", "value"})
    amount = value.get("value")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < minimum:
        raise _bad(f"{where}.value", amount, f"must be an integer of at least {minimum}")
    return value["type"], amount


def _names(value: Any, where: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise _bad(where, value, "must be a list of tool names")
    return frozenset(value)


def _clear_inputs(value: Any, where: str) -> bool | frozenset[str]:
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, list):
        return _names(value, f"{where}.clear_tool_inputs")
    raise _bad(f"{where}.clear_tool_inputs", value, "must be a boolean or a list of tool names")


def _fields(value: Any, where: str, known: set[str]) -> None:
    if not isinstance(value, Mapping):
        raise _bad(where, value, "must be an object")
    extra = sorted(set(value) - known)
    if extra:
        raise _bad(f"{where}.{extra[0]}", value[extra[0]], "is not a field of this object (extra inputs are not "
                                                           "permitted)")


def _bad(where: str, value: Any, why: str) -> BadRequest:
    shown = repr(value)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    return BadRequest(f"{where}: {shown} {why}", param=where)
