"""Whether a call fits each deployment's context window, in that deployment's own tokens, and the output cap it gets.

The gateway counts prompts in cl100k; a deployment counts them with its own tokenizer, which may need more
tokens for the same text (the tiny pair once needed 2.2x). Far from a window, a bound from the cl100k count
decides; near it (`near_edge`), the deployment's own count (its /tokenize, gathered before `decide`) does.
Everything here is pure: the counts arrive as data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.features import BYTES_PER_TOKEN_ESTIMATE, TEMPLATE_TOKENS_PER_MESSAGE, Features
from gateway.policy.model import Policy

# The most deployment tokens one cl100k token of a prompt is taken to cost when the deployment is not asked.
# Measured (python -m serving.tokenizer_ratio on serving/samples/agent_text.txt): the tiny pair's tokenizer
# 1.19x on agent text, 2.02x before it was retrained on more text. Open-weight families' 100k+ vocabularies
# count code and English within ~1.2x of cl100k. 1.5 leaves room for text unlike the sample; a prompt whose
# bound comes within this of a window is counted by the deployment itself, so the bound only decides "far".
TOKENS_PER_CL100K_MAX = 1.5
# A chat template's tool list: its instructions and each schema's spacing, beyond the schemas' compact text.
TOOLS_TEMPLATE_TOKENS = 128
# The fewest output tokens a window must leave a prompt to serve it at all.
MIN_ROOM_TOKENS = 16
GENERATING = frozenset({"chat", "completions", "responses", "messages"})


def window_of(configured: int | None, learned: int | None) -> int | None:
    """A deployment's window: what it reports (vLLM's max_model_len), narrowed by the policy's `max_model_len`
    where that is smaller (the policy may keep room back; a larger one would only earn the deployment's 400)."""
    if configured is None or learned is None:
        return configured if learned is None else learned
    return min(configured, learned)


def template_tokens(features: Features) -> int:
    """What a chat template adds to the prompt's texts: each message's role and separators, the tool list's
    instructions, the generation prompt."""
    tools = TOOLS_TEMPLATE_TOKENS if features.tools_count else 0
    return TEMPLATE_TOKENS_PER_MESSAGE * (features.message_count + 1) + tools


def prompt_bound(features: Features) -> int:
    """At most this many tokens of any deployment's tokenizer, without asking one: an exact cl100k count times
    TOKENS_PER_CL100K_MAX, else (the count was estimated from UTF-8 bytes) the bytes themselves, which no
    byte-level tokenizer exceeds."""
    if features.prompt_tokens_exact:
        texts = math.ceil(features.prompt_tokens * TOKENS_PER_CL100K_MAX)
    else:
        texts = features.prompt_tokens * BYTES_PER_TOKEN_ESTIMATE
    return texts + template_tokens(features)


def wanted_room(features: Features) -> int:
    """The output room that decides whether a count is needed: the call's cap, else the least useful room."""
    return features.max_tokens if features.max_tokens is not None else MIN_ROOM_TOKENS


def near_edge(window: int | None, features: Features) -> bool:
    """Whether the bound could overflow the window with the output the call asks for: only then does the
    deployment's own count change the decision (which deployment fits, or the cap it is sent)."""
    return window is not None and features.endpoint in GENERATING and \
        prompt_bound(features) + wanted_room(features) > window


@dataclass(frozen=True, slots=True)
class Count:
    """A prompt's size in one deployment's tokens, as the gateway got it before deciding."""

    tokens: int
    counted: bool  # the deployment's tokenizer counted it; else its count failed and this is a bound


@dataclass(frozen=True, slots=True)
class Fit:
    """One deployment's window against one call."""

    window: int
    prompt_tokens: int  # in the deployment's tokens: its count, else the bound
    counted: bool
    fits: bool  # the prompt leaves room for an answer
    cap: int | None  # the output cap the call is sent (its own, clamped to the room); None: left as it is

    def describe(self, name: str) -> str:
        how = "counted by its tokenizer" if self.counted else "at most, not counted by its tokenizer"
        return f"{name}'s window of {self.window:,} tokens holds a prompt of {self.prompt_tokens:,} ({how})"


def fit(window: int, features: Features, count: Count | None) -> Fit:
    """The call against a window: by the deployment's count when there is one, else by the bound."""
    tokens, counted = (count.tokens, count.counted) if count is not None else (prompt_bound(features), False)
    room = window - tokens
    fits = room >= min(wanted_room(features), MIN_ROOM_TOKENS)
    cap = None
    if features.max_tokens is not None and features.max_tokens > room:
        cap = max(room, 0)
    return Fit(window, tokens, counted, fits, cap)


def fits_of(
    policy: Policy, features: Features, windows: Mapping[str, int], counts: Mapping[str, Count]
) -> dict[str, Fit]:
    """Each deployment with a known window against the call (none for a call that generates nothing)."""
    if features.endpoint not in GENERATING:
        return {}
    found: dict[str, Fit] = {}
    for name, dep in policy.deployments.items():
        window = window_of(dep.max_model_len, windows.get(name))
        if window is not None:
            found[name] = fit(window, features, counts.get(name))
    return found


def note(name: str, found: Fit, features: Features) -> str | None:
    """The trail's note on the deployment chosen: a clamped output cap, or None."""
    if found.cap is None:
        return None
    return (f"context: max_tokens {features.max_tokens:,} clamped to {found.cap:,}: {found.describe(name)}, "
            f"which leaves that much")


def exclusion(name: str, found: Fit) -> str:
    """Why a deployment whose window the call does not fit is skipped."""
    room = found.window - found.prompt_tokens
    left = f"leaving {room:,} for the answer" if room > 0 else "with no room for an answer"
    return f"context window too small: {found.describe(name)}, {left}"


def caps(budget: Mapping[str, int] | None, fits: Mapping[str, Fit]) -> Mapping[str, int] | None:
    """The output cap each deployment is sent: the smaller of the budget's hold and the window's room."""
    clamped = {name: found.cap for name, found in fits.items() if found.cap is not None}
    if not clamped:
        return budget
    merged = dict(budget or {})
    for name, cap in clamped.items():
        merged[name] = min(cap, merged.get(name, cap))
    return merged
