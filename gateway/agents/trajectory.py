"""An agent session's trajectory as data: each step's digest (tool calls asked for, tool results sent back) and
the session's summary, built from a request's messages and its response without keeping either.

Tool calls come from the response (a non-streamed body's `message.tool_calls`, or the `delta.tool_calls` of
a stream, accumulated); tool results from the request (the `tool` messages after its last assistant
message: what the agent sends back this step). Arguments and outputs are kept as digests only, unless the
operator opts in to prompts (then `arguments`, `content` and `prompt` are kept too, truncated).

Bounded whatever the client sends: the messages read are the last MAX_MESSAGES (as for routing, steps.py),
of which at most MAX_TOOL_RESULTS tool outputs (the latest); at most MAX_TOOL_CALLS tool calls a response;
each text is digested by its first KEPT_CHARS and its size. So a step's record has a size bound whatever
the size of the request, and reading it costs the same bounded time.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.agents.outcomes import Membership, Outcome
from gateway.agents.session_ids import names_session, shown_id, text_of
from gateway.agents.steps import MAX_MESSAGES, canonical
from gateway.agents.tool_outcomes import Verdict, judge
from gateway.apis.chat import wire as chat_wire
from gateway.features import Features

KEPT_CHARS = 4096  # an opted-in prompt, argument or tool output is truncated to this; longer texts are digested
#                    by this much and their size
MAX_TOOL_RESULTS = 64  # tool outputs recorded per step (the latest ones); agents send back a few at a time
MAX_TOOL_CALLS = 64  # tool calls recorded per response (the first ones)
NAME_CHARS = 128  # a tool's name, a call's id


def digest(text: str) -> str:
    """A short stable digest (16 hex characters) that tells equal things apart without keeping them; a text
    longer than KEPT_CHARS is digested by its start and its length (bounded cost, whatever its size)."""
    if len(text) > KEPT_CHARS:
        text = f"{text[:KEPT_CHARS]}\0{len(text)}"
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


def args_digest(arguments: Any) -> str:
    """The digest of a tool call's arguments, the same whatever their key order or spacing (steps.canonical:
    the routing rules' `repeated_calls` compares calls the same way)."""
    return digest(canonical(arguments))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for."""

    name: str
    args_digest: str
    call_id: str = ""
    arguments: str | None = None  # only when prompts are kept

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "args_digest": self.args_digest, "id": self.call_id}
        if self.arguments is not None:
            out["arguments"] = self.arguments
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ToolCall:
        return cls(str(raw.get("name", "")), str(raw.get("args_digest", "")), str(raw.get("id", "")),
                   raw.get("arguments"))


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool output the agent sent back: which call, ok or failed and what said so (tool_outcomes), its size."""

    tool_call_id: str
    ok: bool  # not known to have failed
    size: int  # characters of the output
    digest: str = ""  # of the output, for the repeated-error check; never shown
    content: str | None = None  # only when prompts are kept
    source: str = ""  # what the verdict read (tool_outcomes.Source); "" in records made before verdicts had one
    exit_code: int | None = None  # when the tool's harness reported one

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tool_call_id": self.tool_call_id, "ok": self.ok, "size": self.size, "d": self.digest}
        if self.source:
            out["source"] = self.source
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.content is not None:
            out["content"] = self.content
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ToolResult:
        code = raw.get("exit_code")
        return cls(str(raw.get("tool_call_id", "")), bool(raw.get("ok", True)), int(raw.get("size", 0)),
                   str(raw.get("d", "")), raw.get("content"), str(raw.get("source", "")),
                   code if isinstance(code, int) else None)


@dataclass(frozen=True, slots=True)
class StepCache:
    """A step's prefix caches (policy `switch`), small: the prompt's tokens each deployment held as predicted
    before the step, what the serving one reported, whether the session moved, the warm-up the step started."""

    prompt_tokens: int  # the prompt, as the prediction counted it
    cached: Mapping[str, int]  # deployment -> predicted tokens of the prompt it held
    reported: int | None = None  # the serving deployment's `cached_tokens`, when its usage carried them
    moved_from: str | None = None  # the deployment of the session's previous step, when this one moved
    warmed: tuple[str, ...] = ()  # deployments holding what a warm-up (not a served step) put there
    warm_up: str | None = None  # the warm-up this step triggered: "<deployment> <outcome>" (decision/warmup.py)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"p": self.prompt_tokens, "c": dict(self.cached)}
        for key, value in (("r", self.reported), ("from", self.moved_from), ("warm", self.warm_up)):
            if value is not None:
                out[key] = value
        if self.warmed:
            out["warmed"] = list(self.warmed)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StepCache:
        cached = raw.get("c")
        return cls(int(raw.get("p", 0)), {str(k): int(v) for k, v in cached.items()} if isinstance(cached, dict)
                   else {}, raw.get("r"), raw.get("from"), tuple(raw.get("warmed", ())), raw.get("warm"))

    def shown(self) -> dict[str, Any]:
        """The admin API's view: per deployment the predicted cached and uncached tokens."""
        deployment, _, outcome = (self.warm_up or "").partition(" ")
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": dict(self.cached),
            "uncached_tokens": {name: max(0, self.prompt_tokens - held) for name, held in self.cached.items()},
            "reported_cached_tokens": self.reported, "switched_from": self.moved_from, "warmed": list(self.warmed),
            "warm_up": {"deployment": deployment, "outcome": outcome} if self.warm_up else None,
        }  # fmt: skip


@dataclass(slots=True)
class Step:
    """One recorded step of a session (one proxied call)."""

    at: float  # epoch seconds when the request arrived
    deployment: str
    rule: str
    arm: str | None
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_ms: float
    ttft_ms: float | None
    status: int
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()
    echo: str = ""  # digest of the last assistant message the agent sent back ("" when none had text)
    rework: bool = False  # it asked for a tool call the session had already made
    flags: tuple[str, ...] = ()
    step: int = 0  # 1-based, given by the store when the step is appended
    prompt: str | None = None  # only when prompts are kept
    cache: StepCache | None = None  # with the policy's `switch` section
    tokens_cached: int = 0  # of tokens_in, read from the deployment's prefix cache (priced apart)
    compaction: str | None = None  # who asked for the compaction the step is or made (exchange.compaction)
    compaction_cost_usd: float = 0.0  # of cost_usd, what went to that compaction's summary
    masked: tuple[int, int] | None = None  # the policy's context rules: (tool outputs masked, tokens saved)
    summarized: tuple[int, int] | None = None  # (old entries in the summary sent, tokens saved)
    retrieved: tuple[int, int] | None = None  # (offloaded pieces put back, the block's tokens)

    def to_dict(self) -> dict[str, Any]:
        """Everything, internal digests included (what the store keeps)."""
        out: dict[str, Any] = {
            "step": self.step, "at": round(self.at, 3), "deployment": self.deployment, "rule": self.rule,
            "arm": self.arm, "tokens_in": self.tokens_in, "tokens_cached": self.tokens_cached,
            "tokens_out": self.tokens_out, "cost_usd": self.cost_usd, "latency_ms": round(self.latency_ms, 3),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3), "status": self.status,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "tool_results": [r.to_dict() for r in self.tool_results],
            "echo": self.echo, "rework": self.rework, "flags": list(self.flags),
        }  # fmt: skip
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.cache is not None:
            out["cache"] = self.cache.to_dict()
        if self.compaction is not None:
            out["compaction"] = {"by": self.compaction, "cost_usd": self.compaction_cost_usd}
        context: dict[str, int] = {}
        if self.masked is not None:
            context |= {"masked_outputs": self.masked[0], "tokens_saved": self.masked[1]}
        if self.summarized is not None:
            context |= {"summarized_entries": self.summarized[0], "summary_tokens_saved": self.summarized[1]}
        if self.retrieved is not None:
            context |= {"retrieved_pieces": self.retrieved[0], "retrieved_tokens": self.retrieved[1]}
        if context:
            out["context"] = context
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Step:
        cache, compaction = raw.get("cache"), raw.get("compaction")
        return cls(
            float(raw["at"]), str(raw.get("deployment", "")), str(raw.get("rule", "")), raw.get("arm"),
            int(raw.get("tokens_in", 0)), int(raw.get("tokens_out", 0)), float(raw.get("cost_usd", 0.0)),
            float(raw.get("latency_ms", 0.0)), raw.get("ttft_ms"), int(raw.get("status", 0)),
            tuple(ToolCall.from_dict(c) for c in raw.get("tool_calls", ())),
            tuple(ToolResult.from_dict(r) for r in raw.get("tool_results", ())),
            str(raw.get("echo", "")), bool(raw.get("rework", False)), tuple(raw.get("flags", ())),
            int(raw.get("step", 0)), raw.get("prompt"),
            cache=StepCache.from_dict(cache) if isinstance(cache, dict) else None,
            tokens_cached=int(raw.get("tokens_cached", 0)),
            compaction=compaction.get("by") if isinstance(compaction, dict) else None,
            compaction_cost_usd=float(compaction.get("cost_usd", 0.0)) if isinstance(compaction, dict) else 0.0,
            masked=_pair(raw.get("context"), "masked_outputs", "tokens_saved"),
            summarized=_pair(raw.get("context"), "summarized_entries", "summary_tokens_saved"),
            retrieved=_pair(raw.get("context"), "retrieved_pieces", "retrieved_tokens"),
        )  # fmt: skip

    def shown(self) -> dict[str, Any]:
        """The admin API's view: the contract's fields (plus opted-in text), no internal digests."""
        out = self.to_dict()
        del out["echo"], out["rework"]
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out["tool_calls"]]
        out["tool_results"] = [{k: v for k, v in r.items() if k != "d"} for r in out["tool_results"]]
        if self.cache is not None:
            out["cache"] = self.cache.shown()
        return out

    @property
    def tool_call_keys(self) -> list[tuple[str, str]]:
        return [(c.name, c.args_digest) for c in self.tool_calls]


def _pair(context: Any, count: str, saved: str) -> tuple[int, int] | None:
    if not isinstance(context, dict) or count not in context:
        return None
    return int(context[count]), int(context.get(saved, 0))


@dataclass(slots=True)
class Summary:
    """A session at a glance: what `GET /admin/sessions` lists (by the id its client gave it: sessions.shown_id)."""

    session_id: str  # the stored id
    tenant: str
    steps: int = 0
    cost_usd: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    started_at: float = 0.0
    last_at: float = 0.0
    steps_per_min: float = 0.0
    deployments: dict[str, int] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)  # every flag the session ever raised, in order
    route: str = ""  # the client model name of its latest step
    rollout: str = ""  # Membership.encode() of the rollout cohort its latest measured step was in ("": none)
    outcome: Outcome | None = None  # the latest report of how the run ended
    replaced: list[Outcome] = field(default_factory=list)  # the reports it replaced, oldest first (bounded)

    @property
    def membership(self) -> Membership | None:
        return Membership.decode(self.rollout) if self.rollout else None

    def to_dict(self) -> dict[str, Any]:
        membership = self.membership
        return {
            "session_id": shown_id(self.session_id), "tenant": self.tenant, "steps": self.steps,
            "cost_usd": round(self.cost_usd, 9), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "started_at": round(self.started_at, 3), "last_at": round(self.last_at, 3),
            "steps_per_min": round(self.steps_per_min, 3), "deployments": dict(self.deployments),
            "flags": list(self.flags), "route": self.route,
            "arm": membership.cohort if membership is not None else None,
            "outcome": self.outcome.to_dict() if self.outcome is not None else None,
            "outcome_history": [o.to_dict() for o in self.replaced],
        }  # fmt: skip


def is_step(features: Features, headers: Mapping[str, str]) -> bool:
    """Whether a call is a step of an agent session worth recording: it names its session (`x-session-id`),
    offers tools, sends tool results back, or continues a conversation. A one-shot completion is not one
    (recording it would fill the record with one-step sessions)."""
    return (features.endpoint != "embeddings"
            and bool(features.tools_count or features.tool_result_turns or features.user_turns > 1
                     or names_session(headers)))


SORTS = {
    "cost": lambda s: s.cost_usd,
    "steps": lambda s: s.steps,
    "rate": lambda s: s.steps_per_min,
    "recent": lambda s: s.last_at,
}


RANKED_SCAN = 5000  # sessions ranked by cost, steps or rate: the most recently active ones


def ranked(summaries: Iterable[Summary], sort: str, limit: int) -> list[Summary]:
    """The top `limit` sessions by `sort` (cost, steps, rate or recent), largest first (ties: first given)."""
    return heapq.nlargest(limit, summaries, key=SORTS[sort])


def steps_per_min(earlier: Sequence[Step], now: float) -> float:
    """The step rate over the trailing minute, a step at `now` included (earlier steps oldest first)."""
    count = 1
    for step in reversed(earlier):
        if step.at <= now - 60.0:
            break
        count += 1
    return float(count)


# --- reading a step out of the request and the response ---


def tool_calls_in_body(raw: bytes, keep: bool = False) -> tuple[ToolCall, ...]:
    """The tool calls of a non-streamed chat completion (every choice's message)."""
    if b'"tool_calls"' not in raw:
        return ()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return ()
    calls: list[ToolCall | None] = []
    for choice in _list(body.get("choices") if isinstance(body, dict) else None):
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            calls += (_call(c.get("id"), c.get("function"), keep) for c in _list(message.get("tool_calls"))
                      if isinstance(c, dict))
    return tuple(c for c in calls if c is not None)[:MAX_TOOL_CALLS]


def tool_calls_in_stream(chunks: Sequence[bytes], keep: bool = False) -> tuple[ToolCall, ...]:
    """The tool calls of a stream, accumulated from its `delta.tool_calls` pieces (name first, arguments
    in fragments). `chunks` may start mid-event: an event that does not parse is skipped."""
    events, _ = chat_wire.split_events(b"".join(chunks))
    parts: dict[tuple[int, int], dict[str, str]] = {}
    for event in events:
        data = chat_wire.event_data(event)
        for choice in _list(data.get("choices") if isinstance(data, dict) else None):
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                _accumulate(parts, choice.get("index", 0), _list(delta.get("tool_calls")))
    calls = (_call(p.get("id"), {"name": p.get("name"), "arguments": p.get("arguments", "")}, keep)
             for _, p in sorted(parts.items()))
    return tuple(c for c in calls if c is not None)[:MAX_TOOL_CALLS]


def _accumulate(parts: dict[tuple[int, int], dict[str, str]], choice: Any, deltas: list[Any]) -> None:
    for position, piece in enumerate(deltas):
        if not isinstance(piece, dict):
            continue
        index = piece.get("index", position)
        key = (choice if isinstance(choice, int) else 0, index if isinstance(index, int) else position)
        if key not in parts and len(parts) >= MAX_TOOL_CALLS:
            continue  # a stream naming ever new indices: keep the first calls, as for a whole body
        part = parts.setdefault(key, {})
        if isinstance(piece.get("id"), str):
            part["id"] = piece["id"]
        function = piece.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                part["name"] = part.get("name", "") + function["name"]
            if isinstance(function.get("arguments"), str):
                part["arguments"] = part.get("arguments", "") + function["arguments"]


def _call(call_id: Any, function: Any, keep: bool) -> ToolCall | None:
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", "")
    kept = None
    if keep:
        kept = (arguments if isinstance(arguments, str) else canonical(arguments))[:KEPT_CHARS]
    return ToolCall(function["name"][:NAME_CHARS], args_digest(arguments), str(call_id or "")[:NAME_CHARS], kept)


@dataclass(frozen=True, slots=True)
class Sent:
    """What a step's record takes from the request's messages (read once, when the step is queued, so the
    request itself need not be kept): the tool outputs it sends back, its echo, the opted-in prompt."""

    tool_results: tuple[ToolResult, ...] = ()
    echo: str = ""
    prompt: str | None = None


def sent(messages: Any, keep: bool = False, judged: Sequence[Verdict] = ()) -> Sent:
    recent = _recent(messages)
    return Sent(tool_results(recent, keep, judged), echo(recent), last_prompt(recent) if keep else None)


def tool_results(messages: Any, keep: bool = False, judged: Sequence[Verdict] = ()) -> tuple[ToolResult, ...]:
    """The tool outputs this request sends back: its `tool` messages after the last assistant message (the
    latest MAX_TOOL_RESULTS of them, within the last MAX_MESSAGES messages). `judged`: the verdicts routing
    read of the latest of them (steps.AgentStep.verdicts), taken as they are where the text judged was the same."""
    found: list[ToolResult] = []
    for message in reversed(_recent(messages)):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("tool", "function"):
            content = message.get("content")
            text = text_of(content)
            call_id = message.get("tool_call_id") or message.get("name") or ""
            if len(found) < len(judged) and isinstance(content, str):  # routing judged this very text
                verdict = judged[len(found)]
            else:
                verdict = judge(text, message.get("is_error"))  # Anthropic's tool_result says so itself
            found.append(ToolResult(str(call_id)[:NAME_CHARS], verdict.ok, len(text), digest(text),
                                    text[:KEPT_CHARS] if keep else None, verdict.source, verdict.exit_code))
            if len(found) == MAX_TOOL_RESULTS:
                break
        elif role == "assistant":
            break
    return tuple(reversed(found))


def echo(messages: Any) -> str:
    """The digest of the last assistant message's text in the request ("" when it has none): what the
    model said last, as the agent sends it back."""
    for message in reversed(_recent(messages)):
        if isinstance(message, dict) and message.get("role") == "assistant":
            text = text_of(message.get("content")).strip()
            return digest(" ".join(text.split())) if text else ""
    return ""


def last_prompt(messages: Any) -> str | None:
    """The last user message's text, truncated (kept only when the operator opts in to prompts)."""
    for message in reversed(_recent(messages)):
        if isinstance(message, dict) and message.get("role") == "user":
            return text_of(message.get("content"))[:KEPT_CHARS]
    return None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _recent(messages: Any) -> list[Any]:
    """The messages a step is read from: the last MAX_MESSAGES (a slice of a slice is no copy of the rest)."""
    found = _list(messages)
    return found if len(found) <= MAX_MESSAGES else found[-MAX_MESSAGES:]
