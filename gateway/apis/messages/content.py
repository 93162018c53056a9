"""The content blocks of a Messages request, checked as Anthropic's API checks them where vLLM accepts nonsense.

vLLM takes a `tool_result` without `tool_use_id`, a tool_use in a user turn or a result no tool_use asked for, and
answers as if they were fine; Anthropic's API refuses each with a 400, and a client written against it relies on
that. An agent's request re-sends its whole history and adds a turn or two: the newest CHECKED_MESSAGES messages
(each by its first events.MAX_PARTS blocks) are checked here, so every turn is checked while it is new at a cost
that does not grow with the session (all 300 messages of a long session cost more than reading them for the
decision does); what vLLM validates itself (every message, the tools) comes back as its 400, in Anthropic's
envelope (wire/messages.deployment_error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.apis import events
from gateway.errors import BadRequest

CHECKED_MESSAGES = 16  # the newest messages checked: an agent's step adds two (its tool call, the results)
# Block type -> the role whose turns may carry it (the rest of Anthropic's block types go by the deployment).
ROLE_OF = {"tool_use": "assistant", "tool_result": "user"}


def check(messages: Sequence[Any], start: int) -> None:
    """The newest messages (from `start` on, whose roles are checked): `user` or `assistant` turns whose blocks
    are well formed, whose tool results answer the tool_use blocks of the turn before, and whose tool_use blocks
    are each answered by the turn after."""
    start = max(start, len(messages) - CHECKED_MESSAGES)
    asked = {}  # blocks first, as Anthropic's API does: a malformed block is named before a pairing it breaks
    for i in range(start, len(messages)):
        content = messages[i].get("content")
        if isinstance(content, list):
            asked[i] = _blocks(i, messages[i]["role"], events.parts(content))
    for i, ids in asked.items():
        _answers(messages, i, ids)


def _blocks(i: int, role: str, blocks: Sequence[Any]) -> list[str]:
    """The ids of the tool_use blocks of one message, its blocks checked."""
    asked = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"messages.{i}.content.{j}: Input should be an object with a string 'type'", i, j)
        kind = block["type"]
        if ROLE_OF.get(kind, role) != role:
            raise _bad(f"messages.{i}.content.{j}: a `{kind}` block belongs in an `{ROLE_OF[kind]}` turn, not a "
                       f"`{role}` one", i, j)
        if kind == "tool_use":
            asked.append(_tool_use(block, f"messages.{i}.content.{j}", i, j))
        elif kind == "tool_result":
            _tool_result(block, f"messages.{i}.content.{j}", i, j)
        elif kind == "text" and not isinstance(block.get("text"), str):
            raise _bad(f"messages.{i}.content.{j}.text.text: Field required (a string)", i, j, "text")
    return asked


def _tool_use(block: dict[str, Any], where: str, i: int, j: int) -> str:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise _bad(f"{where}.tool_use.{name}: Field required (a non-empty string)", i, j, name)
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{where}.tool_use.input: Input should be a valid dictionary", i, j, "input")
    return str(block["id"])


def _tool_result(block: dict[str, Any], where: str, i: int, j: int) -> None:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise _bad(f"{where}.tool_result.tool_use_id: Field required (a non-empty string)", i, j, "tool_use_id")
    content = block.get("content")
    if content is not None and not isinstance(content, str | list):
        raise _bad(f"{where}.tool_result.content: Input should be a string or a list of blocks", i, j, "content")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise _bad(f"{where}.tool_result.is_error: Input should be a valid boolean", i, j, "is_error")


def _answers(messages: Sequence[Any], i: int, asked: list[str]) -> None:
    """The tool_use ids of message i are each answered by a tool_result of the next message, if one follows; the
    tool results of message i each answer a tool_use of the message before."""
    if asked and i + 1 < len(messages):
        answered = _result_ids(messages[i + 1])
        missing = [a for a in asked if a not in answered]
        if missing:
            raise _bad(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                       f"{', '.join(missing[:5])}. Each `tool_use` block must have a corresponding `tool_result` "
                       f"block in the next message.", i)
    results = _result_ids(messages[i])
    if results:
        before = messages[i - 1] if i > 0 else None
        offered = set(_use_ids(before))
        unexpected = [r for r in results if r not in offered]
        if unexpected:
            raise _bad(f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: "
                       f"{', '.join(unexpected[:5])}. Each `tool_result` block must have a corresponding `tool_use` "
                       f"block in the previous message.", i)


def _result_ids(message: Any) -> list[str]:
    return _ids(message, "tool_result", "tool_use_id")


def _use_ids(message: Any) -> list[str]:
    return _ids(message, "tool_use", "id")


def _ids(message: Any, kind: str, field: str) -> list[str]:
    content = message.get("content") if isinstance(message, dict) else None
    return [b[field] for b in events.parts(content)
            if isinstance(b, dict) and b.get("type") == kind and isinstance(b.get(field), str)]


def _bad(message: str, i: int, j: int | None = None, name: str | None = None) -> BadRequest:
    param = f"messages[{i}]" + (f".content[{j}]" if j is not None else "") + (f".{name}" if name else "")
    return BadRequest(message, param=param)
