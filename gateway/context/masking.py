"""Old tool outputs masked by stubs, sticky and in batches, over a neutral view of any agent API's body (pure).

    masking = mask(outputs, rule)         which outputs give way to a stub, and each stub

A masked output is replaced whole by its stub (never cut inside: a stub is no half of a JSON document or a file):
a line naming the original's reference (its SHA-256), size and exit code, then its first and last lines. The stub
is a function of the original alone, so a masked output reads the same bytes at every later step.

The frontier (how many of the oldest outputs are masked) is a function of the outputs' sequence alone: the
conversation is replayed output by output, and the frontier jumps to just before the newest `keep_last` only once
at least `batch_tokens` can be saved at once (Anthropic's `clear_at_least`). An agent's next step re-sends the same
outputs plus new ones, so the frontier never moves back and moves rarely: between two moves, step n+1's prompt
starts with step n's byte for byte and the deployment's prefix cache keeps hitting.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.agents.tool_outcomes import judge
from gateway.context.counting import Count, text_tokens

MASK = "mask_tool_outputs"  # the name of the rule in the policy, the trail and the metrics
REF_PREFIX = "ctx_"
REF_PATTERN = re.compile(r"^ctx_[0-9a-f]{64}$")
# The stub's first line: what the model reads, and what the gateway reads back when a client (or the Responses
# API's stored conversation) sends a stub again: it is never masked twice, and counts as the original did.
TOOL_OUTPUT, ASSISTANT_TURN = "tool output", "assistant turn"  # what a stub stands for, its first words
_LEADS = tuple(f"[{kind} masked by the gateway to save context: " for kind in (TOOL_OUTPUT, ASSISTANT_TURN))
_FIRST_LINE = re.compile(r"^\[(?:tool output|assistant turn) masked by the gateway to save context: (\d+) bytes, "
                         r"(\d+) tokens(?:, exit code (-?\d+))?; the whole output is (ctx_[0-9a-f]{64})")
MEMO_MAX_CHARS = 16_384  # outputs up to this long have their stub memoized (a session re-sends them every step)
TRAIL_REFS = 8  # the newest masked outputs' references the decision trail names


@dataclass(frozen=True, slots=True)
class MaskRule:
    """When tool outputs are masked: never the newest `keep_last`; only outputs over `over_tokens`; the frontier
    moves only when at least `batch_tokens` can be saved at once; a stub shows `head_chars` and `tail_chars`."""

    keep_last: int = 3
    over_tokens: int = 200
    batch_tokens: int = 8_000
    head_chars: int = 600
    tail_chars: int = 600


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """One tool output of a prompt, oldest first, as every API's adapter reads it."""

    text: str | None  # what the model reads; None: not text alone (an image), never masked
    is_error: bool | None = None  # the API's own flag (Anthropic's `is_error`), for the exit code
    kind: str = TOOL_OUTPUT  # or ASSISTANT_TURN: an agent's own text, masked only to fit a window


@dataclass(frozen=True, slots=True)
class Stub:
    """An output's stub and what it saves; a pure function of the output."""

    ref: str
    text: str
    tokens: int  # the original's
    saved: int  # the original's tokens less the stub's (<= 0: not worth masking)


@dataclass(frozen=True, slots=True)
class Masked:
    """One output given way to its stub in this prompt."""

    index: int  # among the prompt's tool outputs, oldest first
    ref: str
    stub: str
    original: str | None  # None: the client sent the stub itself (masked at an earlier step)
    tokens_saved: int


@dataclass(frozen=True, slots=True)
class Masking:
    """What masking did to one prompt."""

    masked: tuple[Masked, ...]
    outputs: int  # the prompt's tool outputs
    frontier: int  # outputs before this index are masked (those worth it)
    keep_last: int

    @property
    def tokens_saved(self) -> int:
        return sum(m.tokens_saved for m in self.masked)

    @property
    def fresh(self) -> tuple[Masked, ...]:
        """The stubs made from an original in this prompt (what the object store must hold)."""
        return tuple(m for m in self.masked if m.original is not None)

    def without_originals(self) -> Masking:
        """The record alone, to be remembered past the request (originals and stubs can be megabytes)."""
        return replace(self, masked=tuple(replace(m, stub="", original=None) for m in self.masked))

    def describe(self) -> dict[str, Any]:
        """For the decision trail."""
        return {"masked": len(self.masked), "outputs": self.outputs, "frontier": self.frontier,
                "keep_last": self.keep_last, "tokens_saved": self.tokens_saved,
                "refs": [m.ref for m in self.masked[-TRAIL_REFS:]]}


def mask(outputs: Sequence[ToolOutput], rule: MaskRule, count: Count = text_tokens) -> Masking:
    """Which outputs give way to their stubs: those worth it before the frontier, never the newest `keep_last`."""
    stubs = [_stub_or_sent(output, rule, count) for output in outputs]
    savings = [max(stub.saved, 0) if stub is not None else 0 for stub in stubs]
    at = frontier(savings, rule.keep_last, rule.batch_tokens)
    masked = []
    for i in range(at):
        stub = stubs[i]
        if stub is not None and savings[i] > 0:
            text = outputs[i].text
            original = None if text == stub.text else text
            masked.append(Masked(i, stub.ref, stub.text, original, savings[i]))
    return Masking(tuple(masked), len(outputs), at, rule.keep_last)


def frontier(savings: Sequence[int], keep_last: int, batch_tokens: int) -> int:
    """How many of the oldest outputs are behind the masking frontier: the conversation replayed output by output,
    the frontier jumping to just before the newest `keep_last` whenever what it would newly pass saves at least
    `batch_tokens` (and something). A function of the outputs alone: the same at every step until it jumps."""
    at, pending = 0, 0
    for old in range(len(savings) - keep_last):  # output `old` leaves the newest keep_last here
        pending += savings[old]
        if pending > 0 and pending >= batch_tokens:
            at, pending = old + 1, 0
    return at


def _stub_or_sent(output: ToolOutput, rule: MaskRule, count: Count) -> Stub | None:
    text = output.text
    if text is None:
        return None
    sent = read_stub(text)
    if sent is not None:  # masked at an earlier step: it stays as it is and counts as its original did
        ref, tokens = sent
        return Stub(ref, text, tokens, tokens - count(text))
    if count is text_tokens and len(text) <= MEMO_MAX_CHARS:
        stub = _memo_stub(text, output.is_error, rule.head_chars, rule.tail_chars, output.kind)
    else:
        stub = stub_of(text, output.is_error, rule.head_chars, rule.tail_chars, count, output.kind)
    return stub if stub.tokens > rule.over_tokens else Stub(stub.ref, stub.text, stub.tokens, 0)


@functools.lru_cache(maxsize=2048)
def _memo_stub(text: str, is_error: bool | None, head_chars: int, tail_chars: int, kind: str) -> Stub:
    return stub_of(text, is_error, head_chars, tail_chars, kind=kind)


def stub_of(text: str, is_error: bool | None, head_chars: int, tail_chars: int, count: Count = text_tokens,
            kind: str = TOOL_OUTPUT) -> Stub:
    """The stub of an output (or an assistant turn): its reference, size, exit code (when its harness wrote
    one), first and last lines."""
    data = text.encode("utf-8", "surrogatepass")
    ref = reference(data)
    tokens = count(text)
    code = judge(text, is_error).exit_code if kind == TOOL_OUTPUT else None
    lead = f"[{kind} masked by the gateway to save context: "
    first = f"{lead}{len(data)} bytes, {tokens} tokens" + ("" if code is None else f", exit code {code}") + \
        f"; the whole output is {ref} (GET /v1/context/{ref})]"
    head, tail = _ends(text, head_chars, tail_chars)
    hidden = len(data) - len(head.encode("utf-8", "surrogatepass")) - len(tail.encode("utf-8", "surrogatepass"))
    parts = [first, *([head] if head else []), f"[... {hidden} bytes not shown ...]", *([tail] if tail else [])]
    stub = "\n".join(parts)
    return Stub(ref, stub, tokens, tokens - count(stub))


def reference(data: bytes) -> str:
    """The content address of an original: the same bytes, the same reference, in every tenant and replica."""
    return REF_PREFIX + hashlib.sha256(data).hexdigest()


def read_stub(text: str) -> tuple[str, int] | None:
    """A stub's reference and its original's tokens (None: the text is no stub)."""
    if not text.startswith(_LEADS):
        return None
    found = _FIRST_LINE.match(text)
    return None if found is None else (found.group(4), int(found.group(2)))


def _ends(text: str, head_chars: int, tail_chars: int) -> tuple[str, str]:
    """The first and last lines shown: cut at a line's end when one is in the second half of the span."""
    if len(text) <= head_chars + tail_chars:
        return text, ""
    head = text[:head_chars]
    cut = head.rfind("\n")
    if cut >= head_chars // 2:
        head = head[:cut]
    tail = text[len(text) - tail_chars:] if tail_chars else ""
    cut = tail.find("\n")
    if 0 <= cut <= tail_chars // 2:
        tail = tail[cut + 1:]
    return head, tail
