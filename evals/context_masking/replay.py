"""Public coding-agent runs replayed through a policy's masking of old tool outputs, step by step.

Each step's prompt is the session's messages before its assistant turn (evals/session_cache), as the agent sent
it and as the deployment receives it once the `mask_tool_outputs` rule has put stubs in place of old tool outputs:
which outputs are worth a stub and where the frontier stands are decided as gateway/context/masking.py decides
them (its `frontier`, the same function), and a masked output's stub is a function of the original's hash alone,
so the same output is the same stub at every later step, as the gateway's is of the original's bytes. Routing and
the caching fake pair are session_cache's (`replay_session`), on the received prompt's chain: the rules read the
masked body and each deployment holds the last prompt it served the session.

The derived sessions keep token counts and hashes, no text, so a stub's size is an estimate (`stub_tokens`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from evals.session_cache.replay import (
    Received,
    Side,
    Tally,
    chain_of_record,
    read_sessions,
    replay_session,
    steps_of,
)
from gateway.context.eviction import EvictRule, Turns, boundary
from gateway.context.masking import MaskRule, frontier
from gateway.context.prefix import EMPTY_CHAIN, Chain, common_tokens
from gateway.context.summaries import continuation_prompt
from gateway.decision.agent_compaction import FIT_RULES, FIT_TURNS
from gateway.features import count_tokens
from gateway.policy.model import Policy

# A stub is its first line (`[tool output masked by the gateway ...: B bytes, T tokens, exit code C; the whole
# output is ctx_<64 hex> (GET /v1/context/ctx_<64 hex>)]`), the `[... N bytes not shown ...]` line, and the
# output's first head_chars and last tail_chars characters (fewer: cut at a line's end). Those two lines measured
# in cl100k with gateway.context.masking.stub_of on 300 outputs of 1.5k-60k characters with an exit code: 97-133
# tokens for the first line (the reference, named twice, is ~70 of them), ~10 for the other; 124 on average.
STUB_FRAME_TOKENS = 124
# Characters per cl100k token of what the head and tail show. Measured on this repository: Python source 3.9-4.1,
# `grep -rn` 3.8, `git log -p` 4.0 (an `ls -l` listing is 2.1: there the estimate is short). The gateway's own
# estimate for long texts is 4 bytes a token (gateway.features.BYTES_PER_TOKEN_ESTIMATE).
CHARS_PER_TOKEN = 4.0

RULE_KEYS = tuple(f.name for f in fields(MaskRule))
# The summarizer's ask (INSTRUCTIONS as the conversation's next turn), in cl100k, with the template's tokens.
ASK_TOKENS = count_tokens(str(continuation_prompt([])[0]["content"])) + 4
SWEEP_KEEP_LAST = (1, 3)
SWEEP_BATCH_TOKENS = (0, 2000, 4000, 8000)
SWEEP_HEAD_TAIL_CHARS = (200, 600)


def stub_tokens(tokens: int, rule: MaskRule) -> int:
    """A stub's tokens, estimated: its two lines, then the head and tail it shows (the whole output when that is
    no longer than them, as stub_of shows it: such a stub saves nothing and is never put in)."""
    return STUB_FRAME_TOKENS + min(tokens, math.ceil((rule.head_chars + rule.tail_chars) / CHARS_PER_TOKEN))


def stub_hash(digest: str) -> str:
    """The stub's hash, of the original's alone: the same output reads as the same stub at every step."""
    return hashlib.blake2b(b"stub\x00" + digest.encode(), digest_size=6).hexdigest()


def savings(messages: Iterable[list[Any]], rule: MaskRule) -> list[int]:
    """What a stub would save for each tool output of the prompt, oldest first (0: never masked), as masking's
    `_stub_or_sent` reckons it: only outputs over `over_tokens`, and only when the stub is the smaller."""
    return [max(tokens - stub_tokens(tokens, rule), 0) if tokens > rule.over_tokens else 0
            for role, tokens, _, _ in messages if role == "t"]


def received(messages: list[list[Any]], rule: MaskRule) -> list[list[Any]]:
    """The prompt as the deployment receives it: the outputs behind the frontier that are worth it, stubbed."""
    worth = savings(messages, rule)
    at = frontier(worth, rule.keep_last, rule.batch_tokens)
    if at == 0:
        return messages
    out, n = [], 0
    for message in messages:
        if message[0] == "t":
            if n < at and worth[n] > 0:
                role, tokens, digest, extra = message
                message = [role, stub_tokens(tokens, rule), stub_hash(digest), extra]
            n += 1
        out.append(message)
    return out


def turns_of(messages: list[list[Any]]) -> Turns:
    """The messages as eviction reads a chat body: the head is the system prompt and the task; a turn starts at
    a user or assistant message (the digests and texts eviction keys summaries by are not needed here)."""
    head = 0
    while head < len(messages) and messages[head][0] == "s":
        head += 1
    head += head < len(messages) and messages[head][0] == "u"
    return Turns(head, tuple(m[1] for m in messages), tuple(m[0] in ("u", "a") for m in messages), (), ())


def before(messages: list[list[Any]]) -> list[list[Any]] | None:
    """The step before's prompt: the messages before this prompt's last assistant turn (None: the first step)."""
    for i in range(len(messages) - 1, 0, -1):
        if messages[i][0] == "a":
            return messages[:i]
    return None


def ready_cut(messages: list[list[Any]], rule: EvictRule) -> int:
    """The span whose summary is ready at this step: the one due at the step before (written after it)."""
    earlier = before(messages)
    return turns_of(messages).head if earlier is None else boundary(turns_of(earlier), rule)


def evicted(messages: list[list[Any]], rule: EvictRule) -> list[list[Any]]:
    """The prompt with the ready summary in place of its old turns (a summary taken as summary_tokens)."""
    head, cut = turns_of(messages).head, ready_cut(messages, rule)
    if cut == head:
        return messages
    span = hashlib.blake2b("".join(m[2] for m in messages[:cut]).encode(), digest_size=6).hexdigest()
    return [*messages[:head], ["u", rule.summary_tokens, span, None], *messages[cut:]]


def managed(messages: list[list[Any]], rule: MaskRule | None, evict: EvictRule | None,
            window: int | None = None) -> list[list[Any]]:
    """What the deployment reads: old turns summarized (as sent), then old tool outputs masked, then, over the
    window, fitted as the gateway fits a step its context rules still leave over every window."""
    if evict is not None:
        messages = evicted(messages, evict)
    messages = messages if rule is None else received(messages, rule)
    return messages if window is None or (rule is None and evict is None) else fitted(messages, window)


def fitted(messages: list[list[Any]], window: int) -> list[list[Any]]:
    """The gateway's last resort for a step over every window (server/pipeline.decided): tool outputs masked by
    each of FIT_RULES in turn until it fits, then assistant turns over FIT_TURNS' size given way to stubs."""
    if chain_of_record(messages)[-1].tokens <= window:
        return messages
    for rule in FIT_RULES:
        out = received(messages, rule)
        if chain_of_record(out)[-1].tokens <= window:
            return out
    return [[role, stub_tokens(tokens, FIT_TURNS), stub_hash(digest), extra]
            if role == "a" and tokens > FIT_TURNS.over_tokens else [role, tokens, digest, extra]
            for role, tokens, digest, extra in out]


def summary_prompt(messages: list[list[Any]], rule: MaskRule | None,
                   evict: EvictRule | None) -> list[list[Any]] | None:
    """The summarizer's prompt written between the step before and this one, if the span moved at the step
    before: that step's prompt as the deployment read it, through the span now due, then the ask."""
    earlier = before(messages) if evict is not None else None
    if evict is None or earlier is None:
        return None
    head, due, used = turns_of(earlier).head, boundary(turns_of(earlier), evict), ready_cut(earlier, evict)
    if due == used:
        return None
    end = due if used == head else head + 1 + (due - used)
    return [*managed(earlier, rule, evict)[:end], ["u", ASK_TOKENS, "ask", None]]


def masker(rule: MaskRule | None, evict: EvictRule | None = None, window: int | None = None) -> Received | None:
    """The step's messages -> what the deployment reads, for session_cache's replay (None: as sent)."""
    if rule is None and evict is None:
        return None
    return lambda messages: managed(messages, rule, evict, window)


def summarizer(rule: MaskRule | None, evict: EvictRule | None) -> Side | None:
    """The step's messages -> the summarizer's prompt written before it, if any (None: no summaries)."""
    return None if evict is None else (lambda messages: summary_prompt(messages, rule, evict))


@dataclass
class Sizes:
    """Every step's prompt as sent and as received, and what one deployment serving every step prefills."""

    sessions: int = 0
    steps: int = 0
    sent: int = 0
    received: int = 0
    moved: int = 0  # steps whose received prompt does not start with the step before's
    prefilled: int = 0  # one deployment serving every received prompt
    unmanaged: int = 0  # one deployment serving every prompt as sent
    older_outputs: int = 0  # tokens of tool outputs older than the newest keep_last, as sent
    largest_sent: int = 0
    largest_received: int = 0
    over_window: int = 0  # steps whose received prompt is over the window checked
    summaries: int = 0  # summaries of old turns written between steps
    summary_prompts: int = 0  # their prompts' tokens (in received too)
    summary_prefilled: int = 0  # what one deployment prefills of them (in prefilled too)

    def add(self, sent: Chain, got: Chain, before_sent: Chain, before_got: Chain, window: int | None) -> None:
        total, kept = got[-1].tokens, common_tokens(before_got, got)
        self.steps += 1
        self.sent += sent[-1].tokens
        self.received += total
        self.moved += bool(before_got) and kept < before_got[-1].tokens
        self.prefilled += total - kept
        self.unmanaged += sent[-1].tokens - common_tokens(before_sent, sent)
        self.largest_sent = max(self.largest_sent, sent[-1].tokens)
        self.largest_received = max(self.largest_received, total)
        self.over_window += window is not None and total > window


def measure_session(messages: list[list[Any]], rule: MaskRule | None, sizes: Sizes, window: int | None,
                    evict: EvictRule | None = None) -> None:
    """One session's steps, as sent and as received by `rule` and `evict` (None: neither), into `sizes`."""
    before_sent: Chain = EMPTY_CHAIN
    before_got: Chain = EMPTY_CHAIN
    keep_last = rule.keep_last if rule is not None else 0
    sizes.sessions += 1
    for index, _ in steps_of(messages):
        sent_messages = messages[:index]
        sent = chain_of_record(sent_messages)
        side = summary_prompt(sent_messages, rule, evict)
        if side is not None:  # on the deployment that holds the step before's prompt: it prefills the ask
            asked = chain_of_record(side)
            sizes.summaries += 1
            sizes.summary_prompts += asked[-1].tokens
            sizes.summary_prefilled += asked[-1].tokens - common_tokens(before_got, asked)
            sizes.received += asked[-1].tokens
            sizes.prefilled += asked[-1].tokens - common_tokens(before_got, asked)
        got = sent if rule is None and evict is None else chain_of_record(managed(sent_messages, rule, evict, window))
        sizes.add(sent, got, before_sent, before_got, window)
        outputs = [tokens for role, tokens, _, _ in sent_messages if role == "t"]
        sizes.older_outputs += sum(outputs[:max(len(outputs) - keep_last, 0)])
        before_sent, before_got = sent, got


def window_of(policy: Policy, window: int | None) -> int | None:
    """The window a received prompt must fit: `window` if given, else the largest max_model_len the policy's
    deployments set (a prompt over it fits none of them), else None (none checked)."""
    if window is not None:
        return window
    lengths = [d.max_model_len for d in policy.deployments.values() if d.max_model_len is not None]
    return max(lengths) if lengths else None


def routings(rule: MaskRule | None, evict: EvictRule | None) -> Iterator[tuple[str, str, bool]]:
    """(name, requested model, managed): auto with the rules, auto unmanaged, every step on fast with the rules."""
    yield "auto, managed", "auto", True
    yield "auto, unmanaged", "auto", False
    yield "fast, managed", "fast", True


def replay(policy: Policy, rule: MaskRule | None, path: str, limit: int | None = None,
           window: int | None = None, evict: EvictRule | None = None) -> list[dict[str, Any]]:
    """Each routing's figures over the sessions; `vs one unmanaged` is against one deployment serving every step
    unmasked (the issue's bound is 1.3x)."""
    names = list(routings(rule, evict))
    tallies = {name: Tally() for name, _, _ in names}
    sizes = {name: Sizes() for name, _, _ in names}
    for session in read_sessions(path, limit):
        for name, model, on in names:
            mask, summarize = (rule, evict) if on else (None, None)
            replay_session(policy, session, model, tallies[name], received=masker(mask, summarize, window),
                           side=summarizer(mask, summarize))
            measure_session(session["messages"], mask, sizes[name], window, summarize)
    return [row(name, tallies[name], sizes[name], sizes["auto, unmanaged"].unmanaged) for name, _, _ in names]


def row(name: str, tally: Tally, sizes: Sizes, unmanaged: int) -> dict[str, Any]:
    steps, sessions = sizes.steps or 1, sizes.sessions or 1
    pair = sum(tally.prefilled.values())
    return {"routing": name, "sessions": sizes.sessions, "steps": sizes.steps,
            "fast_share": tally.steps["fast"] / steps, "hq_share": tally.steps["hq"] / steps,
            "sent_tokens": sizes.sent, "received_tokens": tally.prompt_tokens,
            "received_over_sent": tally.prompt_tokens / (sizes.sent or 1),
            "prefilled_tokens": pair, "prefilled_vs_unmanaged_one": pair / (unmanaged or 1),
            "one_deployment_prefilled_vs_unmanaged": sizes.prefilled / (unmanaged or 1),
            "prefix_moved_steps": sizes.moved, "prefix_moved_share": sizes.moved / steps,
            "switches_per_session": tally.switches / sessions,
            "largest_sent": sizes.largest_sent, "largest_received": sizes.largest_received,
            "over_window_steps": sizes.over_window,
            "older_outputs_share": sizes.older_outputs / (sizes.sent or 1),
            "summaries_per_session": sizes.summaries / sessions,
            "summary_prompt_share": tally.side_prompt_tokens / (tally.prompt_tokens or 1)}


def sweep_rules(base: MaskRule) -> Iterator[MaskRule]:
    """The grid ops read to see what a ratio would take: keep_last x batch_tokens x head/tail characters."""
    for keep_last in SWEEP_KEEP_LAST:
        for batch in SWEEP_BATCH_TOKENS:
            for chars in SWEEP_HEAD_TAIL_CHARS:
                yield replace(base, keep_last=keep_last, batch_tokens=batch, head_chars=chars, tail_chars=chars)


def sweep(policy: Policy, base: MaskRule, path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """For each rule of the grid: received/sent, the share of steps whose prefix moved, and what auto's pair and
    one deployment prefill against one unmanaged deployment."""
    rules = list(sweep_rules(base))
    tallies = [Tally() for _ in rules]
    sizes = [Sizes() for _ in rules]
    for session in read_sessions(path, limit):
        for rule, tally, size in zip(rules, tallies, sizes, strict=True):
            replay_session(policy, session, "auto", tally, received=masker(rule))
            measure_session(session["messages"], rule, size, None)
    return [{"rule": rule_dict(rule)} | row("auto, managed", tally, size, size.unmanaged)
            for rule, tally, size in zip(rules, tallies, sizes, strict=True)]


def parse_evict(text: str, base: EvictRule | None) -> EvictRule:
    """`over_tokens=N,keep_tokens=N,summary_tokens=N` over `base` (the policy's, else the defaults)."""
    keys = tuple(f.name for f in fields(EvictRule))
    given: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in keys:
            raise ValueError(f"--summarize: {part!r} is not one of {', '.join(k + '=N' for k in keys)}")
        given[key.strip()] = int(value)
    rule = replace(base or EvictRule(), **given)
    if rule.over_tokens <= rule.keep_tokens + rule.summary_tokens:
        raise ValueError("--summarize: over_tokens must be more than keep_tokens + summary_tokens")
    return rule


def rule_dict(rule: MaskRule) -> dict[str, int]:
    return {key: getattr(rule, key) for key in RULE_KEYS}


def parse_rule(text: str, base: MaskRule) -> MaskRule:
    """`keep_last=K,batch_tokens=N,...` over `base` (the fields not named keep its values)."""
    given: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in RULE_KEYS:
            raise ValueError(f"--rule: {part!r} is not one of {', '.join(k + '=N' for k in RULE_KEYS)}")
        number = int(value)
        if number < 0:
            raise ValueError(f"--rule: {key.strip()} must be 0 or more")
        given[key.strip()] = number
    return replace(base, **given)
