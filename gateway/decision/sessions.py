"""Agent session identity: which session a request belongs to (its state lives in the store).

    sid = session_id(headers, body)          # pure; None when the request carries nothing to go by
    state = (await budgets.observe(tenant, sid, rules)).session   # one atomic store call counts the step
    admission(..., session=state, sessions=policy.sessions)       # decision/admission.py

The pin and the running cost are written by the settle of the session's first answered step (the pin
names the deployment that answered, after any failover), inside the same atomic store script, so a
session pinned on one replica reads the same pin on every other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

HEADER = "x-session-id"
MAX_ID_CHARS = 256


def session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The `x-session-id` header; else, from a conversation's second step on, a hash of who calls (the
    API key, the `user` field) and how the conversation opened (system prompt, first user message, first
    assistant turn); else None: a first step looks like every conversation that opens the same way.

    Only a header names a session exactly: two conversations of one caller that open alike and get the
    same first reply (temperature 0) share the derived session.
    """
    given = headers.get(HEADER)
    if given:
        return "h:" + given[:MAX_ID_CHARS]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    first_user = _first(messages, ("user",))
    first_reply = _first(messages, ("assistant",))
    if first_user is None or first_reply is None:
        return None
    user = body.get("user")
    parts = (
        headers.get("authorization") or headers.get("x-api-key") or "",
        user if isinstance(user, str) else "",
        _turn(_first(messages, ("system", "developer"))),
        _turn(first_user),
        _turn(first_reply),
    )
    seed = "\x00".join(parts).encode("utf-8", "replace")
    return "p:" + hashlib.sha256(seed).hexdigest()[:32]


def _first(messages: list[Any], roles: tuple[str, ...]) -> Mapping[str, Any] | None:
    for message in messages:
        if isinstance(message, Mapping) and message.get("role") in roles:
            return message
    return None


def _turn(message: Mapping[str, Any] | None) -> str:
    """A message's text and the tool calls it made (an agent's first reply is often only a tool call)."""
    if message is None:
        return ""
    calls = message.get("tool_calls")
    made = [
        f"{fn.get('name', '')}({fn.get('arguments', '')})"
        for call in (calls if isinstance(calls, list) else ())
        if isinstance(call, Mapping) and isinstance(fn := call.get("function"), Mapping)
    ]
    return "\n".join([text_of(message.get("content")), *made])


def text_of(content: Any) -> str:
    """Content as plain text, whether a string or a list of parts ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""
