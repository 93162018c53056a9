"""Agent session identity: which session a request belongs to (its state lives in the store).

    sid = session_id(headers, view, chain)   # pure; None when the request carries nothing to go by
    state = (await budgets.observe(tenant, sid, rules)).session   # one atomic store call counts the step
    admission(..., session=state, sessions=policy.sessions)       # decision/admission.py

The id a user sees and types is not the key the gateway stores a session by. A session the client names is
stored as "h:<its id>"; one the gateway names itself (derived from the conversation, "p:<hash>", or the root of
a Responses chain, "r:<response id>") has no client id and goes by that name. `stored_id`, `shown_id` and
`stored_ids` are the one mapping between the two: every admin answer, CLI line, page link, outcome, span and log
shows `shown_id`, every lookup by a user's id goes through `stored_ids`.

The pin and the running cost are written by the settle of the session's first answered step (the pin
names the deployment that answered, after any failover), inside the same atomic store script, so a
session pinned on one replica reads the same pin on every other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

HEADER = "x-session-id"
# What real agents send: Codex CLI names its session in `session-id` (and in the JSON of its turn metadata),
# Claude Code in X-Claude-Code-Session-Id. Header names are read lower-cased (aiohttp's are case-blind).
CODEX_HEADER = "session-id"
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
CLAUDE_CODE_HEADER = "x-claude-code-session-id"
MAX_ID_CHARS = 256
MAX_METADATA_CHARS = 4096
NAMED = "h:"  # the stored id of a session the client names: this, then its id
GATEWAY_NAMED = ("p:", "r:")  # the stored ids the gateway gives sessions no client named (derived, a chain's root)


def session_id(headers: Mapping[str, str], body: Mapping[str, Any], chain: str | None = None) -> str | None:
    """The session a request names; else the one its Responses chain is in (`chain`, the stored previous
    response's: wire/stored.py chain_session); else derived from the conversation (`body` chat-shaped).

    Named, in this order: `x-session-id`; Codex's `session-id` header, or the `session_id` of its
    `x-codex-turn-metadata`; Claude Code's `x-claude-code-session-id`.
    """
    given = _named(headers)
    if given:
        return stored_id(given)
    if chain:
        return chain
    return derived(headers, body)


def stored_id(client_id: str) -> str:
    """The key a session the client names (its `x-session-id` or agent header) is stored by."""
    return NAMED + client_id[:MAX_ID_CHARS]


def shown_id(stored: str) -> str:
    """The id users see for a stored session: the client's own id, or the gateway's name when no client named it."""
    return stored[len(NAMED):] if stored.startswith(NAMED) else stored


def stored_ids(shown: str) -> tuple[str, ...]:
    """The stored sessions a user's id may name: the session a client named so, and, for an id of the form the
    gateway names sessions by (p:…, r:…), that session too (two found: the id is ambiguous)."""
    named = stored_id(shown)
    return (named, shown) if shown.startswith(GATEWAY_NAMED) and shown != named else (named,)


def names_session(headers: Mapping[str, str]) -> bool:
    """Whether the client names its session in a header (then every call of it is a step worth recording)."""
    return _named(headers) is not None


def _named(headers: Mapping[str, str]) -> str | None:
    return (headers.get(HEADER) or headers.get(CODEX_HEADER) or _codex_metadata(headers.get(CODEX_METADATA_HEADER))
            or headers.get(CLAUDE_CODE_HEADER) or None)


def _codex_metadata(raw: str | None) -> str | None:
    """The `session_id` of Codex's turn metadata (a JSON object); None for anything else, never an error."""
    if not raw or len(raw) > MAX_METADATA_CHARS:
        return None
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    value = found.get("session_id") if isinstance(found, dict) else None
    return value if isinstance(value, str) and value else None


def derived(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """From a conversation's second step on, a hash of who calls (the API key, the `user` field) and how the
    conversation opened (system prompt, first user message, first assistant turn); else None: a first step
    looks like every conversation that opens the same way.

    Only a name the client sends is exact: two conversations of one caller that open alike and get the
    same first reply (temperature 0) share the derived session.
    """
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
