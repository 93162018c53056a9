"""Replay the derived sessions step by step through a policy in front of a caching fake pair.

Each step's prompt is the session's messages before its assistant turn, sent as a tool-calling agent sends it
(one `bash` tool). It is decided by the gateway's own path: features and agent step read from the chat body,
the per-deployment prefix caches predicted by decision/switch.session_cache from the session's record, gathered
by decision/gathering.gather, decided by routing.decide. The fake pair caches as vLLM's prefix cache does when
nothing is evicted: each deployment holds the last prompt it served the session, so a step prefills what its
deployment has not seen. What the texts said is not kept: messages carry their token count and a hash.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.context.prefix import (
    EMPTY_CHAIN,
    NO_PREFIXES,
    Chain,
    Link,
    SessionPrefixes,
    after_serving,
    after_warming,
    common_tokens,
)
from gateway.decision.call import read_call
from gateway.decision.gathering import Logged, Surroundings, gather
from gateway.decision.routing import decide
from gateway.decision.switch import session_cache
from gateway.features import TEMPLATE_TOKENS_PER_MESSAGE, extract
from gateway.policy.model import Policy

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run one bash command",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string"}}, "required": ["command"]}}}]
TOOLS_TOKENS = 60  # the one tool's definition as a chat template renders it
CACHED_INPUT_SHARE = 0.1  # a cache read's price against fresh input, as hosted APIs charge it
Received = Callable[[list[list[Any]]], list[list[Any]]]  # a step's messages -> what the deployment reads
Side = Callable[[list[list[Any]]], list[list[Any]] | None]  # a step's messages -> a side call's prompt before it
SIDE_DEPLOYMENT = "fast"  # who writes the summaries (the policy's compaction deployment by default)


def read_sessions(path: str, limit: int | None = None) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if limit is not None and n >= limit:
                return
            yield json.loads(line)


def steps_of(messages: list[list[Any]]) -> Iterator[tuple[int, int]]:
    """(index of each assistant turn, its tokens): the step's prompt is every message before it."""
    for i, (role, tokens, _, _) in enumerate(messages):
        if role == "a" and i > 0:
            yield i, tokens


def chat_body(messages: list[list[Any]], model: str) -> dict[str, Any]:
    """The messages as a tool-calling agent sends them; contents are the hashes (the rules read the roles, the
    tool calls' arguments and a tool result's exit code, which the derived set keeps)."""
    out: list[dict[str, Any]] = []
    for n, (role, _, digest, extra) in enumerate(messages):
        if role == "s":
            out.append({"role": "system", "content": digest})
        elif role == "u":
            out.append({"role": "user", "content": digest})
        elif role == "a":
            calls = [{"id": f"call_{n}", "type": "function",
                      "function": {"name": "bash", "arguments": json.dumps({"command": extra})}}] if extra else None
            out.append({"role": "assistant", "content": digest, **({"tool_calls": calls} if calls else {})})
        else:
            code = extra[1] if extra else None  # the exit code the run recorded, shown as mini-swe-agent shows it
            shown = digest if code is None else f"<returncode>{code}</returncode>\n<output>\n{digest}\n</output>"
            out.append({"role": "tool", "tool_call_id": f"call_{n - 1}", "content": shown})
    return {"model": model, "messages": out, "tools": TOOLS}


def chain_of_record(messages: list[list[Any]]) -> Chain:
    """The prompt's chain from the recorded token counts (the gateway's chain_of shares the prompt's count out by
    bytes; here each message's own count is known)."""
    digest, through = hashlib.blake2b(b"tools", digest_size=8).digest(), TOOLS_TOKENS
    links = [Link(digest.hex(), through)]
    for _, tokens, text_hash, _ in messages:
        digest = hashlib.blake2b(digest + text_hash.encode(), digest_size=8).digest()
        through += tokens + TEMPLATE_TOKENS_PER_MESSAGE
        links.append(Link(digest.hex(), through))
    return Chain.of(links)


@dataclass
class Tally:
    """One routing's replay over every session."""

    sessions: int = 0
    steps: Counter[str] = field(default_factory=Counter)  # deployment -> steps served
    switches: int = 0
    prefilled: Counter[str] = field(default_factory=Counter)  # deployment -> tokens prefilled
    prompt_tokens: int = 0
    single_prefilled: int = 0  # what one deployment serving every step would prefill
    prefill_ms: float = 0.0
    cost_usd: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)  # switch verdicts, first words
    side_calls: int = 0  # summaries written between steps
    side_prompt_tokens: int = 0  # their prompts (in prompt_tokens too)

    def row(self, name: str) -> dict[str, Any]:
        steps = sum(self.steps.values()) or 1
        sessions = self.sessions or 1
        pair = sum(self.prefilled.values())
        return {"routing": name, "sessions": self.sessions, "steps": steps,
                "fast_share": self.steps["fast"] / steps, "hq_share": self.steps["hq"] / steps,
                "switches_per_session": self.switches / sessions,
                "prefilled_per_session": pair / sessions,
                "prefilled_vs_one": pair / (self.single_prefilled or 1),
                "prefill_s_per_session": self.prefill_ms / 1000 / sessions,
                "cost_usd_per_session": self.cost_usd / sessions}


def replay_session(policy: Policy, session: dict[str, Any], model: str, tally: Tally, *,
                   free_switch: bool = False, received: Received | None = None, side: Side | None = None) -> None:
    """One session's steps through `policy` for `model`; `free_switch`: as if both deployments had cached every
    step (the rules' routing with no switch ever paying: the bound no cache-keeping routing can beat);
    `received`: the step's messages as the deployment receives them (the gateway's context edits, decided on
    before routing, as the gateway does), else as the agent sent them; `side`: a call made between the step
    before and this one (a summary of old turns), prefilled on fast, which holds its prompt after it."""
    messages = session["messages"]
    record: SessionPrefixes = NO_PREFIXES
    previous: Chain = EMPTY_CHAIN
    tally.sessions += 1
    prefill_rate = dict(policy.switch.prefill_ms_per_1k_tokens) if policy.switch else {}
    for index, output_tokens in steps_of(messages):
        sent = messages[:index]
        side_messages = side(sent) if side is not None else None
        if side_messages is not None:
            record = _side_call(policy, tally, record, chain_of_record(side_messages))
        prompt_messages = sent if received is None else received(sent)
        body = chat_body(prompt_messages, model)
        features = extract(body, "chat")
        prompt = chain_of_record(prompt_messages)
        total = prompt[-1].tokens
        features = dataclasses.replace(features, prompt_tokens=total)
        call = read_call(policy, "chat", body, body, 0, features, {}, None)
        cache = session_cache(record, prompt)
        ctx = gather(call, Logged(None), Surroundings(cache=cache))
        decision = decide(policy, features, ctx)
        served = decision.deployment
        for line in decision.reasons:
            if line.startswith("switch:"):
                tally.reasons[" ".join(line.split()[:2])] += 1
        single = total - common_tokens(previous, prompt)
        uncached = single if free_switch else total - cache.cached.get(served, 0)
        tally.steps[served] += 1
        tally.switches += record.home is not None and record.home != served
        tally.prefilled[served] += uncached
        tally.single_prefilled += single
        tally.prompt_tokens += total
        tally.prefill_ms += prefill_rate.get(served, 0.0) * uncached / 1000
        price = policy.deployments[served].price
        tally.cost_usd += (uncached + CACHED_INPUT_SHARE * (total - uncached)) * price.input_per_mtok_usd / 1e6
        tally.cost_usd += output_tokens * price.output_per_mtok_usd / 1e6
        record, previous = after_serving(record, served, prompt), prompt


def _side_call(policy: Policy, tally: Tally, record: SessionPrefixes, prompt: Chain) -> SessionPrefixes:
    """A summary written on fast between two steps: what fast lacks of its prompt prefilled, its tokens priced."""
    name = SIDE_DEPLOYMENT if SIDE_DEPLOYMENT in policy.deployments else policy.default
    total = prompt[-1].tokens
    uncached = total - common_tokens(record.served.get(name, EMPTY_CHAIN), prompt)
    tally.side_calls += 1
    tally.side_prompt_tokens += total
    tally.prompt_tokens += total
    tally.prefilled[name] += uncached
    price = policy.deployments[name].price
    tally.cost_usd += (uncached + CACHED_INPUT_SHARE * (total - uncached)) * price.input_per_mtok_usd / 1e6
    return after_warming(record, name, prompt)


def replay(policy: Policy, before: Policy, path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The figures of each routing: auto before (the `before` policy) and after, hq, fast, the free-switch
    bound; prefill time and price from the after policy's `switch` section and deployments."""
    tallies = {name: Tally() for name in ("auto before", "auto after", "hq", "fast", "free-switch bound")}
    timed = before.model_copy(update={"switch": policy.switch}) if policy.switch else before
    for session in read_sessions(path, limit):
        replay_session(_untimed(before, policy), session, "auto", tallies["auto before"])
        replay_session(policy, session, "auto", tallies["auto after"])
        replay_session(timed, session, "hq", tallies["hq"])
        replay_session(timed, session, "fast", tallies["fast"])
        replay_session(_untimed(before, policy), session, "auto", tallies["free-switch bound"], free_switch=True)
    return [tally.row(name) | {"switch_verdicts": dict(tally.reasons)} for name, tally in tallies.items()]


def _untimed(before: Policy, after: Policy) -> Policy:
    """The before policy as it routes (its own switch section, if any), timed with the after policy's prefill
    rates when it has none of its own: every routing's prefill seconds on one scale."""
    if before.switch is not None or after.switch is None:
        return before
    return before.model_copy(update={"switch": after.switch.model_copy(update={"weight": 0.0, "min_stay_steps": 1})})
