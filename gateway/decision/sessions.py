"""Agent session identity: which session a request belongs to (its state lives in the store).

    sid = session_id(headers, body)          # pure; None when the request carries nothing to go by
    state = (await budgets.observe(tenant, sid, rules)).session   # one atomic store call counts the step
    admission(..., session=state, sessions=policy.sessions)       # decision/admission.py

The pin is written by the reserve of the session's first admitted step (`Budgets.reserve(...,
session_id=sid)`) and the running cost by its settle, both inside the same atomic store scripts, so a
session pinned on one replica reads the same pin on every other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

HEADER = "x-session-id"
MAX_ID_CHARS = 256


def session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The `x-session-id` header, else the `user` field, else a hash of the system + first user message."""
    given = headers.get(HEADER)
    if given:
        return "h:" + given[:MAX_ID_CHARS]
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user[:MAX_ID_CHARS]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    system = _first_text(messages, ("system", "developer"))
    first_user = _first_text(messages, ("user",))
    if first_user is None:
        return None
    seed = f"{system or ''}\x00{first_user}".encode("utf-8", "replace")
    return "p:" + hashlib.sha256(seed).hexdigest()[:32]


def _first_text(messages: list[Any], roles: tuple[str, ...]) -> str | None:
    for message in messages:
        if isinstance(message, Mapping) and message.get("role") in roles:
            return _text(message.get("content"))
    return None


def _text(content: Any) -> str:
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
