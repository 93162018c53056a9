"""A prompt's prefix as a hash chain over its messages, and how much of it a deployment's prefix cache holds.

    prompt = chain_of(view, prompt_tokens)          one link per message (the tools first), each with the tokens
                                                    through it; pure, the cost of hashing the prompt's text once
    cached = common_tokens(kept, prompt)            tokens of the longest prefix both chains share
    kept = rescaled(prompt, usage.prompt_tokens)    what a deployment holds after serving the prompt, in the
                                                    deployment's own count

A deployment's prefix cache (vLLM's automatic prefix caching) holds the prompt it served last for a session, up
to the block it filled: the next step re-sends that prompt plus the new messages, so the link where two chains
part is where the deployment starts to prefill. Each link hashes the one before it, so equal links mean equal
prompts up to there, whatever came later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pydantic_core
import xxhash

DIGEST_BYTES = 8  # 64 bits: two prompts of one session colliding is not a worry worth more bytes
MAX_LINKS = 1024  # a chain longer than this keeps its first links: a prediction then says less, never wrong
TOOLS_ROLE = "tools"  # the first link: the tool definitions the chat template renders before the messages


class Link(NamedTuple):
    """One message of a prompt. A named tuple: a chain is built per request, one link per message (tens to
    hundreds), and a frozen dataclass sets each field through object.__setattr__ at about ten times the cost."""

    digest: str  # hex; hashes this message and every link before it
    tokens: int  # the prompt's tokens through this message


Chain = tuple[Link, ...]


@dataclass(frozen=True, slots=True)
class SessionPrefixes:
    """A session's record: the prompt each deployment last served it, and where its last step went."""

    served: Mapping[str, Chain]  # deployment -> the chain of the last prompt it served the session
    home: str | None = None  # the deployment that served the session's last step
    stay: int = 0  # the session's steps on `home` in a row
    warmed: frozenset[str] = frozenset()  # deployments whose chain a warm-up put there, not a served step


NO_PREFIXES = SessionPrefixes({})


def after_serving(record: SessionPrefixes, deployment: str, served: Chain) -> SessionPrefixes:
    """The record once `deployment` served the session a step whose prompt is `served` (what every store
    does, in one atomic step)."""
    stay = record.stay + 1 if record.home == deployment else 1
    return SessionPrefixes({**record.served, deployment: served}, deployment, stay, record.warmed - {deployment})


def after_warming(record: SessionPrefixes, deployment: str, warmed: Chain) -> SessionPrefixes:
    """The record once a warm-up made `deployment` prefill the prompt `warmed`: it holds that chain now, but the
    session has not moved (its home and stay are the served steps')."""
    return SessionPrefixes({**record.served, deployment: warmed}, record.home, record.stay,
                           record.warmed | {deployment})


def chain_of(view: Mapping[str, Any], prompt_tokens: int, tools_sent: bytes | None = None) -> Chain:
    """The chat view's prompt as links (its tools, then each message); the tokens through each link are
    `prompt_tokens` shared out by the size of what each link hashed (a deployment's exact figure replaces
    them once it has served the prompt: `rescaled`). `tools_sent`: the tools' bytes as the client sent them
    (json_body.Source), hashed as they are rather than encoded again."""
    pieces = _pieces(view, tools_sent)
    if not pieces:
        return ()
    total_bytes = sum(len(piece) for piece in pieces) or 1
    links: list[Link] = []
    # Each link's digest hashes its piece seeded with the link before, so it stands for the whole prompt through
    # it. XXH3: the links predict a cache, so a collision costs a wrong prediction, never data, and a
    # cryptographic hash took several times as long on an agent's 100-200 KB step.
    digest = 0
    through = 0
    for piece in pieces[:MAX_LINKS]:
        digest = xxhash.xxh3_64_intdigest(piece, digest)
        through += len(piece)
        links.append(Link(f"{digest:016x}", prompt_tokens * through // total_bytes))
    return tuple(links)


def _pieces(view: Mapping[str, Any], tools_sent: bytes | None) -> list[bytes]:
    """What each link hashes: the tools' JSON (when the call offers tools), then each message's text."""
    pieces: list[bytes] = []
    tools = view.get("tools")
    if tools:
        pieces.append(TOOLS_ROLE.encode() + b"\x00" + (tools_sent if tools_sent is not None else _json(tools)))
    messages = view.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, Mapping):
            pieces.append(_message_text(message).encode("utf-8", "surrogatepass"))
    return pieces


def _message_text(message: Mapping[str, Any]) -> str:
    """Its role, content, the call it answers and the calls it makes (an agent's assistant turn is often only a
    call), joined by NULs. Strings are joined as they are: only a content of parts, or a call of an odd shape,
    is encoded as JSON (an agent's step holds tens of calls; encoding each cost more than hashing the step)."""
    content = message.get("content")
    parts = [str(message.get("role")), content if isinstance(content, str) else _text(content)]
    answers = message.get("tool_call_id")
    if answers is not None:
        parts.append(str(answers))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            parts += (str(call.get("id")), str(function.get("name")), _text(function.get("arguments")))
        else:
            parts.append(_text(call))
    return "\x00".join(parts)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return _json(value).decode("utf-8", "surrogatepass")


def _json(value: Any) -> bytes:
    return pydantic_core.to_json(value, fallback=str)


def common_tokens(kept: Sequence[Link], prompt: Sequence[Link]) -> int:
    """The tokens of `kept` (what a deployment holds) through the last link the prompt shares with it: 0 when
    the two part at the first link. Links hash their whole past, so the walk stops at the first difference."""
    through = 0
    for held, wanted in zip(kept, prompt, strict=False):
        if held.digest != wanted.digest:
            break
        through = held.tokens
    return through


def rescaled(prompt: Chain, prompt_tokens: int) -> Chain:
    """The chain with its token counts scaled to `prompt_tokens` (the deployment's own count of the prompt)."""
    if not prompt or prompt_tokens <= 0:
        return prompt
    estimated = prompt[-1].tokens or 1
    return tuple(Link(link.digest, link.tokens * prompt_tokens // estimated) for link in prompt)


def encode(chain: Sequence[Link]) -> str:
    """`digest:tokens,...`: the chain as the store keeps it."""
    return ",".join(f"{link.digest}:{link.tokens}" for link in chain)


def decode(text: str) -> Chain:
    """A stored chain; links that do not read as `digest:tokens` end it (what is before them still holds)."""
    links: list[Link] = []
    for item in text.split(",") if text else ():
        digest, _, tokens = item.partition(":")
        if not digest or not tokens.isdigit():
            break
        links.append(Link(digest, int(tokens)))
    return tuple(links)
