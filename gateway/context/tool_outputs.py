"""Each agent API's tool outputs as masking's neutral view, and its body with stubs put in their place (pure).

    chat        `role: tool` messages                      (Chat Completions)
    responses   `function_call_output` input items          (Responses: Codex CLI, the Agents SDK)
    messages    `tool_result` blocks of the user's turns    (Anthropic Messages: Claude Code)

A stub replaces an output's whole content (a string); every other field (ids, `is_error`, `cache_control`)
stays, and only the messages it touches are copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gateway.context.counting import Count, text_tokens
from gateway.context.masking import ASSISTANT_TURN, Masking, MaskRule, ToolOutput, mask

Where = tuple[int, ...]  # the output's place: a message's or item's index (and a block's, in Messages)
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


class ToolOutputs(Protocol):
    """One API's tool outputs: found in a body, and the body with some of them replaced."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]: ...

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]: ...


def masked_body(shape: ToolOutputs, body: dict[str, Any], rule: MaskRule,
                count: Count = text_tokens) -> tuple[dict[str, Any], Masking]:
    """The body with its old tool outputs masked by `rule`, and what was masked."""
    found = shape.find(body)
    masking = mask([output for _, output in found], rule, count)
    changed = {found[m.index][0]: m.stub for m in masking.masked if m.original is not None}
    return (shape.replaced(body, changed) if changed else body), masking


def _text(content: Any) -> str | None:
    """An output's text when it is text alone: a string, or parts that are all text (joined by newlines, as
    vLLM's chat templates join them); None otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)


def _items_replaced(body: Mapping[str, Any], stubs: Mapping[Where, str],
                    fields: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """A Responses body whose input items at the stubs' places take the fields each stub makes."""
    items = list(_list(body, "input"))
    for (i, *_), stub in stubs.items():
        items[i] = {**items[i], **fields(stub)}
    return {**body, "input": items}


def _list(body: Mapping[str, Any], key: str) -> Sequence[Any]:
    found = body.get(key)
    return found if isinstance(found, list) else ()


class ChatOutputs:
    """Chat Completions: each `role: tool` message's content."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        return [((i,), ToolOutput(_text(m.get("content")))) for i, m in enumerate(_list(body, "messages"))
                if isinstance(m, Mapping) and m.get("role") == "tool"]

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        messages = list(_list(body, "messages"))
        for (i, *_), stub in stubs.items():
            messages[i] = {**messages[i], "content": stub}
        return {**body, "messages": messages}


class ResponsesOutputs:
    """Responses: each `function_call_output` (and `custom_tool_call_output`) input item's output."""

    KINDS = frozenset({"function_call_output", "custom_tool_call_output"})

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        return [((i,), ToolOutput(_text(item.get("output")))) for i, item in enumerate(_list(body, "input"))
                if isinstance(item, Mapping) and item.get("type") in self.KINDS]

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        return _items_replaced(body, stubs, lambda stub: {"output": stub})


class MessagesOutputs:
    """Anthropic Messages: each `tool_result` block's content, with its `is_error` flag."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        found: list[tuple[Where, ToolOutput]] = []
        for i, message in enumerate(_list(body, "messages")):
            if not isinstance(message, Mapping) or message.get("role") != "user":
                continue
            for j, block in enumerate(_list(message, "content")):
                if isinstance(block, Mapping) and block.get("type") == "tool_result":
                    flag = block.get("is_error")
                    found.append(((i, j), ToolOutput(_text(block.get("content")),
                                                     flag if isinstance(flag, bool) else None)))
        return found

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        messages = list(_list(body, "messages"))
        copied: set[int] = set()
        for (i, j), stub in stubs.items():
            if i not in copied:
                messages[i] = {**messages[i], "content": list(messages[i]["content"])}
                copied.add(i)
            messages[i]["content"][j] = {**messages[i]["content"][j], "content": stub}
        return {**body, "messages": messages}


CHAT = ChatOutputs()
RESPONSES = ResponsesOutputs()
MESSAGES = MessagesOutputs()


def _assistant_turns(entries: Sequence[Any]) -> list[tuple[Where, ToolOutput]]:
    """Each assistant message's (Chat) or message item's (Responses) text, by its index."""
    return [((i,), ToolOutput(_text(entry.get("content")), kind=ASSISTANT_TURN))
            for i, entry in enumerate(entries)
            if isinstance(entry, Mapping) and entry.get("role") == "assistant" and entry.get("content")]


class ChatAssistantTexts:
    """Chat Completions: each assistant message's text (its tool calls stay), for fitting a window."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        return _assistant_turns(_list(body, "messages"))

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        return CHAT.replaced(body, stubs)


class ResponsesAssistantTexts:
    """Responses: each assistant message item's text."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        return _assistant_turns(_list(body, "input"))

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        return _items_replaced(body, stubs, lambda stub: {"content": [{"type": "output_text", "text": stub}]})


class MessagesAssistantTexts:
    """Anthropic Messages: each text block of the assistant's turns (its tool_use blocks stay)."""

    def find(self, body: Mapping[str, Any]) -> list[tuple[Where, ToolOutput]]:
        found: list[tuple[Where, ToolOutput]] = []
        for i, message in enumerate(_list(body, "messages")):
            if not isinstance(message, Mapping) or message.get("role") != "assistant":
                continue
            content = message.get("content")
            if isinstance(content, str):
                found.append(((i, -1), ToolOutput(content, kind=ASSISTANT_TURN)))
                continue
            for j, block in enumerate(content if isinstance(content, list) else ()):
                if isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str):
                    found.append(((i, j), ToolOutput(block["text"], kind=ASSISTANT_TURN)))
        return found

    def replaced(self, body: Mapping[str, Any], stubs: Mapping[Where, str]) -> dict[str, Any]:
        messages = list(_list(body, "messages"))
        for (i, j), stub in stubs.items():
            if j == -1:
                messages[i] = {**messages[i], "content": stub}
                continue
            content = list(messages[i]["content"])
            content[j] = {**content[j], "text": stub}
            messages[i] = {**messages[i], "content": content}
        return {**body, "messages": messages}


CHAT_ASSISTANT = ChatAssistantTexts()
RESPONSES_ASSISTANT = ResponsesAssistantTexts()
MESSAGES_ASSISTANT = MessagesAssistantTexts()
