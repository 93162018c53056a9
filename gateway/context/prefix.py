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

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import xxhash

from gateway.apis import json_body
from gateway.apis.recurring import Conversation, Recurring, resume

MAX_LINKS = 1024  # a chain longer than this keeps its first links: a prediction then says less, never wrong
TOOLS_ROLE = "tools"  # the first link: the tool definitions the chat template renders before the messages


class Link(NamedTuple):
    """One message of a prompt, as a chain shows it (`Chain.of`, `chain[i]`, iterating one)."""

    digest: str  # hex; hashes this message and every link before it
    tokens: int  # the prompt's tokens through this message


class Chain:
    """A prompt's links: `digests[i]` (hex) hashes message i and every link before it, `tokens[i]` counts the
    prompt's tokens through it. Two lists, not a tuple a link: a chain is built per request, one link per message
    (hundreds on an agent's step), then rescaled once served, and the rescaled chain shares the digests. Neither
    list is changed once the chain holds it."""

    __slots__ = ("digests", "tokens")

    def __init__(self, digests: list[str] | None = None, tokens: list[int] | None = None) -> None:
        self.digests: list[str] = digests if digests is not None else []
        self.tokens: list[int] = tokens if tokens is not None else []
        if len(self.digests) != len(self.tokens):
            raise ValueError(f"a chain of {len(self.digests)} digests and {len(self.tokens)} token counts")

    @classmethod
    def of(cls, links: Iterable[tuple[str, int]]) -> Chain:
        pairs = list(links)
        return cls([digest for digest, _ in pairs], [tokens for _, tokens in pairs])

    @property
    def total(self) -> int:
        """The prompt's tokens (through its last link); 0 for a chain of none."""
        return self.tokens[-1] if self.tokens else 0

    def __len__(self) -> int:
        return len(self.digests)

    @overload
    def __getitem__(self, index: int) -> Link: ...
    @overload
    def __getitem__(self, index: slice) -> Chain: ...
    def __getitem__(self, index: int | slice) -> Link | Chain:
        if isinstance(index, slice):
            return Chain(self.digests[index], self.tokens[index])
        return Link(self.digests[index], self.tokens[index])

    def __iter__(self) -> Iterator[Link]:
        return map(Link, self.digests, self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and self.digests == other.digests and self.tokens == other.tokens

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Chain.of({list(self)!r})"


EMPTY_CHAIN = Chain()


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


def chain_of(view: Mapping[str, Any], prompt_tokens: int, tools_sent: memoryview | None = None,
             recurring: Recurring | None = None, conversation: Conversation | None = None) -> Chain:
    """The chat view's prompt as links (its tools, then each message); the tokens through each link are
    `prompt_tokens` shared out by the size of what each link hashed (a deployment's exact figure replaces
    them once it has served the prompt: `rescaled`). `tools_sent`: the tools' bytes as the client sent them
    (json_body.Source), hashed as they are rather than encoded again. `recurring`: the memory the messages were
    parsed through, where each message's own digest is noted once for every step that re-sends it;
    `conversation`: the one it keeps for them, where the links through the step before are noted (a step then
    hashes only the messages it adds)."""
    hashed = _hashed(view, tools_sent, recurring, conversation)
    digests, sizes = hashed.digests, hashed.sizes
    if not digests:
        return EMPTY_CHAIN
    total = sizes[-1] or 1
    return Chain(digests, [prompt_tokens * size // total for size in sizes])  # the digests are never changed


_HEX = "{:016x}".format
_MAPPING = (dict, Mapping)  # a parsed body's objects are dicts: checked first, without the ABC's own check
_TOOLS_SEED = xxhash.xxh3_64_intdigest(TOOLS_ROLE)  # the tools' link: seeded apart from any message's
_NOTE = "prefix.own"  # a message's own digest and size, noted in the parse memory
_HASHED = "prefix.hashed"  # a conversation's links, noted in the parse memory
_TOOLS_NOTE = "prefix.tools"  # the tools' link (digest, size), noted on their parse in the parse memory


class _Hashed(NamedTuple):
    """A prompt's links as hashed: each one's digest (hex) and the size of what the prompt hashed through it; with
    where the hashing stands after them, for a step that adds messages."""

    tools: int | None  # the tools' link's digest (None: the call offers no tools), which seeds every message's
    digests: list[str]
    sizes: list[int]
    digest: int  # the last link's, as an int
    through: int  # the size hashed through the last link


def _hashed(view: Mapping[str, Any], tools_sent: memoryview | None, recurring: Recurring | None,
            conversation: Conversation | None) -> _Hashed:
    """Each link's digest and the size of what the prompt hashed through it: the tools' JSON (when the call
    offers tools), then each message. A message's link hashes its own digest (its fields hashed one after the
    other) seeded with the link before, so it stands for the whole prompt through it; its own digest depends on
    the message alone, so a message the client re-sends is hashed once (noted in `recurring`), and the links of
    the step a conversation continues are taken from its notes when they were seeded by the same tools.
    XXH3: the links predict a cache, so a collision costs a wrong prediction, never data; a cryptographic hash
    took several times as long on an agent's 100-200 KB step, as did joining a message's fields into one text."""
    digests: list[str] = []
    sizes: list[int] = []
    digest = through = 0
    tools_digest = None
    tools = view.get("tools")
    if tools:
        tools_digest, through = _tools_link(tools, tools_sent, recurring)
        digest = tools_digest
        digests.append(_HEX(digest))
        sizes.append(through)
    messages = view.get("messages")
    if not isinstance(messages, list):
        return _Hashed(tools_digest, digests, sizes, digest, through)
    end = MAX_LINKS - len(digests)  # the messages that get links
    earlier, start, noting = resume(conversation, messages, _HASHED)
    if earlier is not None and earlier.tools == tools_digest:
        start = min(start, end)
        digests, sizes, digest, through = list(earlier.digests), list(earlier.sizes), earlier.digest, earlier.through
    else:
        start = 0  # the first step, or other tools seed every link
    notes_of = recurring.notes if recurring is not None else _no_notes
    for message in messages[start:end]:
        if isinstance(message, _MAPPING):
            notes = notes_of(message)
            own = notes.get(_NOTE) if notes is not None else None
            if own is None:
                own = _message_digest(message)
                if notes is not None:
                    notes[_NOTE] = own
            digest = xxhash.xxh3_64_intdigest(own[0], digest)
            through += own[1]
            digests.append(_HEX(digest))
            sizes.append(through)
    hashed = _Hashed(tools_digest, digests, sizes, digest, through)
    if noting is not None:
        noting[_HASHED] = hashed  # its lists are never changed: the step that continues it copies them
    return hashed


def _no_notes(value: Any) -> None:
    return None


def _tools_link(tools: Any, tools_sent: memoryview | None, recurring: Recurring | None) -> tuple[int, int]:
    """The tools' link: the digest of their JSON and its size. Hashed as sent, it is noted on the tools' parse
    while `recurring` keeps it (the parse stands for those very bytes): an agent re-sends the same 10-50 KB of
    schemas at every step."""
    notes = recurring.notes(tools) if recurring is not None and tools_sent is not None else None
    found: tuple[int, int] | None = notes.get(_TOOLS_NOTE) if notes is not None else None
    if found is None:
        piece = tools_sent if tools_sent is not None else _json(tools)
        found = (_hash(piece, _TOOLS_SEED), len(piece))
        if notes is not None:
            notes[_TOOLS_NOTE] = found
    return found


def _message_digest(message: Mapping[str, Any]) -> tuple[bytes, int]:
    """The message's role, content, the call it answers and the calls it makes (an agent's assistant turn is
    often only a call), hashed one after the other; and their size. Strings are hashed as they are: only a
    content of parts, or a call of an odd shape, is encoded as JSON."""
    content = message.get("content")
    text = content if isinstance(content, str) else _text(content)
    digest = _hash(text, _hash(str(message.get("role")), 0))
    size = len(text)
    answers = message.get("tool_call_id")
    if answers is not None:
        digest = _hash(str(answers), digest)
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, _MAPPING) else None
        if isinstance(function, _MAPPING):
            arguments = _text(function.get("arguments"))
            digest = _hash(arguments, _hash(str(function.get("name")), _hash(str(call.get("id")), digest)))
            size += len(arguments)
        else:
            text = _text(call)
            digest = _hash(text, digest)
            size += len(text)
    return digest.to_bytes(8, "little"), size


def _hash(data: str | bytes | memoryview, seed: int) -> int:
    try:
        return xxhash.xxh3_64_intdigest(data, seed)
    except UnicodeEncodeError:  # a lone surrogate, which JSON text may carry
        return xxhash.xxh3_64_intdigest(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data,
                                        seed)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return _json(value).decode("utf-8", "surrogatepass")


def _json(value: Any) -> bytes:
    return json_body.encode(value)  # compact; a lone surrogate, which JSON text may carry, escaped


def common_tokens(kept: Chain, prompt: Chain) -> int:
    """The tokens of `kept` (what a deployment holds) through the last link the prompt shares with it: 0 when
    the two part at the first link. Links hash their whole past, so the walk stops at the first difference."""
    held, wanted = kept.digests, prompt.digests
    if held and wanted[:len(held)] == held:  # a step that continues the one kept: compared in C
        return kept.tokens[-1]
    through = 0
    for index, digest in enumerate(held[:len(wanted)]):
        if digest != wanted[index]:
            break
        through = kept.tokens[index]
    return through


def rescaled(prompt: Chain, prompt_tokens: int) -> Chain:
    """The chain with its token counts scaled to `prompt_tokens` (the deployment's own count of the prompt)."""
    if not prompt or prompt_tokens <= 0:
        return prompt
    estimated = prompt.total or 1
    return Chain(prompt.digests, [tokens * prompt_tokens // estimated for tokens in prompt.tokens])


def encode(chain: Chain) -> str:
    """`digest:tokens,...`: the chain as the store keeps it."""
    return ",".join(map("{}:{}".format, chain.digests, chain.tokens))


def decode(text: str) -> Chain:
    """A stored chain; links that do not read as `digest:tokens` end it (what is before them still holds)."""
    digests: list[str] = []
    tokens: list[int] = []
    for item in text.split(",") if text else ():
        digest, _, count = item.partition(":")
        if not digest or not count.isdigit():
            break
        digests.append(digest)
        tokens.append(int(count))
    return Chain(digests, tokens)
