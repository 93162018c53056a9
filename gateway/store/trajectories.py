"""Agent trajectories in the store: each session's recent steps, summary, active flags and bucketed spend.

Contract (`RedisTrajectoryStore` here, `trajectory_memory.MemoryTrajectoryStore` its in-process twin):

    read(refs, count) -> {ref: SessionRecord}          each session's last `count` steps, summary, active
                                                        flags and spend buckets, in one round trip
    tenant_spend(tenants) -> {tenant: SpendSeries}
    append(appends, tenant_forget, limits)              the batch's steps, summaries, flags and spend, in one
                                                        MULTI/EXEC; bounded per session (max_steps_per_session)
                                                        and in total (max_sessions: the largest tenant's least
                                                        recent session evicted first, see fair_evictions), TTL
    active(ref) -> {flag: (until, detail)}              what the request path reads before deciding
    sessions(tenant | None, limit, sort) -> [Summary]    most recently active first, or the top `limit` by
                                                        `sort` among the RANKED_SCAN most recent
    find(session_ids, tenant | None) -> [Ref]           the recorded sessions of any of these ids, in the
                                                        tenant or any tenant (a lookup per tenant and id), most
                                                        recently active first
    session(session_id, tenant | None) -> (Summary, [Step]) | None     a session is (tenant, id); without a
                                                        tenant, the most recent of that id
    set_outcome(ref, outcome) -> (Summary, replaced Outcome | None) | None
                                                        a known session's outcome (None: unknown, nothing
                                                        written); keeps the last HISTORY_KEPT reports
    close()

Redis keys (d = digest of "tenant<TAB>session id"): `{p}:tr:s:{d}` the summary hash (id, tenant, steps,
cost, tin, tout, started, last, rate, d:<deployment> step counts, f:<flag> first raised at, a:<flag>
"until detail" while active, b:<bucket> spend, route, ro the rollout membership, on the count of outcome
reports and o:<n> the n-th report's JSON, the last HISTORY_KEPT kept), `{p}:tr:l:{d}` the steps list
(JSON, oldest first; a step's number is the summary's count minus its distance from the end), `{p}:tr:idx` and
`{p}:tr:idx:{tenant}` sorted sets of "tenant<TAB>session id" by last activity, `{p}:tr:tenants` the sorted
set of tenants by last activity (for fair eviction and lookups without a tenant), `{p}:tr:spend:{tenant}`
the tenant's spend buckets (and `since`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.agents.outcomes import HISTORY_KEPT, Outcome
from gateway.agents.spikes import bucket
from gateway.agents.trajectory import RANKED_SCAN, Step, Summary, ranked
from gateway.policy.agents import Recording
from gateway.store.redis_store import RedisStore

Ref = tuple[str, str]  # (tenant, session id)
Active = dict[str, tuple[float, str]]  # flag -> (active until, what showed it)
SEP = "\t"  # between tenant and session id in index members: tenant names cannot hold it
MAX_STEP_CHARS = 64 * 1024  # a stored step's JSON (ASCII: json escapes the rest)


@dataclass(slots=True)
class SpendSeries:
    """Spend in buckets ({bucket index: USD}) since a first-seen time."""

    since: float = 0.0
    buckets: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class SessionRecord:
    """What the flusher reads of a session before adding its new steps (steps_total 0: a new session)."""

    steps_total: int = 0
    started_at: float = 0.0
    last_at: float = 0.0
    steps: list[Step] = field(default_factory=list)
    active: Active = field(default_factory=dict)
    spend: SpendSeries = field(default_factory=SpendSeries)


@dataclass(slots=True)
class Append:
    """One new step with the session's state after it."""

    tenant: str
    session_id: str
    step: Step
    steps_per_min: float
    active: Active  # set (replacing the same flags)
    cleared: tuple[str, ...] = ()  # no longer active
    raised: tuple[str, ...] = ()  # added to the session's flags
    forget: tuple[int, ...] = ()  # spend buckets too old to matter
    route: str = ""  # the client model name the step asked for
    rollout: str = ""  # Membership.encode() of the rollout cohort it was measured in ("": none)


class TrajectoryStore(Protocol):
    async def read(self, refs: Sequence[Ref], count: int) -> dict[Ref, SessionRecord]: ...
    async def tenant_spend(self, tenants: Sequence[str]) -> dict[str, SpendSeries]: ...
    async def append(
        self, appends: Sequence[Append], tenant_forget: Mapping[str, Sequence[int]], limits: Recording
    ) -> None: ...
    async def active(self, ref: Ref) -> Active: ...
    async def sessions(self, tenant: str | None, limit: int, sort: str = "recent") -> list[Summary]: ...
    async def find(self, session_ids: Sequence[str], tenant: str | None = None) -> list[Ref]: ...
    async def session(self, session_id: str, tenant: str | None = None) -> tuple[Summary, list[Step]] | None: ...
    async def set_outcome(self, ref: Ref, outcome: Outcome) -> tuple[Summary, Outcome | None] | None: ...
    async def close(self) -> None: ...


def fair_evictions(sizes: Mapping[str, int], count: int) -> dict[str, int]:
    """How many sessions each tenant gives up so that `count` go, largest tenant first (one at a time, so
    tenants left level share the rest): a tenant that floods the record evicts its own sessions, and never
    those of a tenant smaller than it (their stop and escalate flags with them)."""
    heap = [(-size, tenant) for tenant, size in sizes.items() if size > 0]
    heapq.heapify(heap)
    out: dict[str, int] = {}
    for _ in range(count):
        if not heap:
            break
        size, tenant = heapq.heappop(heap)
        out[tenant] = out.get(tenant, 0) + 1
        if size + 1 < 0:
            heapq.heappush(heap, (size + 1, tenant))
    return out


def member(ref: Ref) -> str:
    return f"{ref[0]}{SEP}{ref[1]}"


def split(name: str) -> Ref:
    tenant, _, session_id = name.partition(SEP)
    return tenant, session_id


def parse_active(fields: Mapping[str, str]) -> Active:
    out: Active = {}
    for name, value in fields.items():
        if name.startswith("a:"):
            until, _, detail = value.partition(" ")
            out[name[2:]] = (float(until), detail)
    return out


def summary_of(fields: Mapping[str, str]) -> Summary:
    """A summary hash (as Redis returns it) as a Summary."""
    flags = sorted((float(v), k[2:]) for k, v in fields.items() if k.startswith("f:"))
    reports = [Outcome.from_dict(json.loads(v)) for _, v in
               sorted((int(k[2:]), v) for k, v in fields.items() if k.startswith("o:"))]
    return Summary(
        fields.get("id", ""), fields.get("tenant", ""), int(fields.get("steps", 0)),
        float(fields.get("cost", 0.0)), int(fields.get("tin", 0)), int(fields.get("tout", 0)),
        float(fields.get("started", 0.0)), float(fields.get("last", 0.0)), float(fields.get("rate", 0.0)),
        {k[2:]: int(v) for k, v in fields.items() if k.startswith("d:")}, [flag for _, flag in flags],
        fields.get("route", ""), fields.get("ro", ""), reports[-1] if reports else None, reports[:-1],
    )  # fmt: skip


def spend_of(fields: Mapping[str, str], since_field: str) -> SpendSeries:
    buckets = {int(k[2:]): float(v) for k, v in fields.items() if k.startswith("b:")}
    return SpendSeries(float(fields.get(since_field, 0.0) or 0.0), buckets)


def numbered(raw: Sequence[str], total: int) -> list[Step]:
    """Stored steps (oldest first) with their numbers: the last one is the session's `total`-th step."""
    steps = []
    for i, text in enumerate(raw):
        step = Step.from_dict(json.loads(text))
        step.step = total - len(raw) + 1 + i
        steps.append(step)
    return steps


def encode(step: Step) -> str:
    """A step as stored: its JSON, at most MAX_STEP_CHARS (the flusher reads a session's recent steps back
    at every step). The step's own bounds keep it well under that unless prompts are kept: then the kept
    texts go first, then tool calls and results from the end, so the digests of the rest stay."""
    out = step.to_dict()
    del out["step"]
    text = json.dumps(out, separators=(",", ":"))
    if len(text) <= MAX_STEP_CHARS:
        return text
    out.pop("prompt", None)
    for kept, key in (("tool_calls", "arguments"), ("tool_results", "content")):
        for item in out[kept]:
            item.pop(key, None)
    text = json.dumps(out, separators=(",", ":"))
    while len(text) > MAX_STEP_CHARS and (out["tool_calls"] or out["tool_results"]):
        longer = max(("tool_calls", "tool_results"), key=lambda k: len(out[k]))
        del out[longer][len(out[longer]) // 2:]
        text = json.dumps(out, separators=(",", ":"))
    return text


class TrajectoryKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _digest(self, ref: Ref) -> str:
        return hashlib.sha256(member(ref).encode()).hexdigest()[:32]

    def summary(self, ref: Ref) -> str:
        return f"{self.prefix}:tr:s:{self._digest(ref)}"

    def steps(self, ref: Ref) -> str:
        return f"{self.prefix}:tr:l:{self._digest(ref)}"

    def index(self, tenant: str | None = None) -> str:
        return f"{self.prefix}:tr:idx" if tenant is None else f"{self.prefix}:tr:idx:{tenant}"

    def tenants(self) -> str:
        return f"{self.prefix}:tr:tenants"

    def spend(self, tenant: str) -> str:
        return f"{self.prefix}:tr:spend:{tenant}"


# KEYS[1] a session's summary hash; ARGV[1] the outcome's JSON, ARGV[2] reports kept. Writes nothing for an
# unknown (or expired) session and returns nil; else the report as o:<n> (dropping o:<n-kept>) and the
# report it replaces ('' for the first).
SET_OUTCOME = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local n = redis.call('HINCRBY', KEYS[1], 'on', 1)
redis.call('HSET', KEYS[1], 'o:' .. n, ARGV[1])
local kept = tonumber(ARGV[2])
if n > kept then redis.call('HDEL', KEYS[1], 'o:' .. (n - kept)) end
return redis.call('HGET', KEYS[1], 'o:' .. (n - 1)) or ''
"""


class RedisTrajectoryStore(RedisStore):
    """TrajectoryStore on Redis: pipelined reads, one MULTI/EXEC per appended batch, bounded by the store's timeout."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.keys = TrajectoryKeys(prefix)
        self._set_outcome = self._redis.register_script(SET_OUTCOME)

    async def read(self, refs: Sequence[Ref], count: int) -> dict[Ref, SessionRecord]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.hgetall(self.keys.summary(ref))
                pipe.lrange(self.keys.steps(ref), -count, -1)
            replies = await self._run(pipe.execute())
        out = {}
        for i, ref in enumerate(refs):
            fields, raw = _strs(replies[2 * i]), [str(s) for s in replies[2 * i + 1]]
            total = int(fields.get("steps", 0))
            out[ref] = SessionRecord(total, float(fields.get("started", 0.0)), float(fields.get("last", 0.0)),
                                     numbered(raw, total) if total else [], parse_active(fields),
                                     spend_of(fields, "started"))
        return out

    async def tenant_spend(self, tenants: Sequence[str]) -> dict[str, SpendSeries]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.hgetall(self.keys.spend(tenant))
            replies = await self._run(pipe.execute())
        return {t: spend_of(_strs(r), "since") for t, r in zip(tenants, replies, strict=True)}

    async def append(
        self, appends: Sequence[Append], tenant_forget: Mapping[str, Sequence[int]], limits: Recording
    ) -> None:
        if not appends:
            return
        newest = max(a.step.at for a in appends)
        async with self._redis.pipeline(transaction=True) as pipe:
            for a in appends:
                self._queue_append(pipe, a, limits)
            for tenant, old in tenant_forget.items():
                if old:
                    pipe.hdel(self.keys.spend(tenant), *(f"b:{b}" for b in old))
            for index in {self.keys.index(), self.keys.tenants(), *(self.keys.index(a.tenant) for a in appends)}:
                pipe.zremrangebyscore(index, "-inf", newest - limits.ttl_s)
            pipe.zcard(self.keys.index())
            replies = await self._run(pipe.execute())
        over = int(replies[-1]) - limits.max_sessions
        if over > 0:
            await self._evict(over, newest - limits.ttl_s)

    def _queue_append(self, pipe: Any, a: Append, limits: Recording) -> None:
        ref, step = (a.tenant, a.session_id), a.step
        summary, steps, ttl = self.keys.summary(ref), self.keys.steps(ref), limits.ttl_s
        pipe.rpush(steps, encode(step))
        pipe.ltrim(steps, -limits.max_steps_per_session, -1)
        pipe.expire(steps, ttl)
        pipe.hsetnx(summary, "started", repr(step.at))
        active = {f"a:{flag}": f"{until!r} {detail}" for flag, (until, detail) in a.active.items()}
        pipe.hset(summary, mapping={"id": a.session_id, "tenant": a.tenant, "last": repr(step.at),
                                    "rate": repr(a.steps_per_min), **active, **_placed(a)})
        pipe.hincrby(summary, "steps", 1)
        pipe.hincrbyfloat(summary, "cost", step.cost_usd)
        pipe.hincrby(summary, "tin", step.tokens_in)
        pipe.hincrby(summary, "tout", step.tokens_out)
        pipe.hincrby(summary, f"d:{step.deployment}", 1)
        for flag in a.raised:
            pipe.hsetnx(summary, f"f:{flag}", repr(step.at))
        stale = [f"a:{flag}" for flag in a.cleared] + [f"b:{b}" for b in a.forget]
        if stale:
            pipe.hdel(summary, *stale)
        if step.cost_usd:
            pipe.hincrbyfloat(summary, f"b:{bucket(step.at)}", step.cost_usd)
            spend = self.keys.spend(a.tenant)
            pipe.hsetnx(spend, "since", repr(step.at))
            pipe.hincrbyfloat(spend, f"b:{bucket(step.at)}", step.cost_usd)
            pipe.expire(spend, ttl)
        pipe.expire(summary, ttl)
        for index in (self.keys.index(), self.keys.index(a.tenant)):
            pipe.zadd(index, {member(ref): step.at})
            pipe.expire(index, ttl)
        pipe.zadd(self.keys.tenants(), {a.tenant: step.at})
        pipe.expire(self.keys.tenants(), ttl)

    async def _evict(self, count: int, expired_before: float) -> None:
        """Drop `count` sessions beyond max_sessions: the least recently active of the largest tenants."""
        tenants = [str(t) for t in await self._run(self._redis.zrange(self.keys.tenants(), 0, -1))]
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.zremrangebyscore(self.keys.index(tenant), "-inf", expired_before)
                pipe.zcard(self.keys.index(tenant))
            sizes = dict(zip(tenants, (await self._run(pipe.execute()))[1::2], strict=True))
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant, n in fair_evictions(sizes, count).items():
                pipe.zpopmin(self.keys.index(tenant), n)
            popped: Any = await self._run(pipe.execute())
        async with self._redis.pipeline(transaction=False) as pipe:
            for name, _score in (item for items in popped for item in items):
                ref = split(str(name))
                pipe.delete(self.keys.summary(ref), self.keys.steps(ref))
                pipe.zrem(self.keys.index(), member(ref))
            await self._run(pipe.execute())

    async def active(self, ref: Ref) -> Active:
        fields = _strs(await self._run(self._redis.hgetall(self.keys.summary(ref))))
        return parse_active(fields)

    async def sessions(self, tenant: str | None, limit: int, sort: str = "recent") -> list[Summary]:
        scan = limit if sort == "recent" else RANKED_SCAN
        members = await self._run(self._redis.zrevrange(self.keys.index(tenant), 0, scan - 1))
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in members:
                pipe.hgetall(self.keys.summary(split(str(name))))
            replies = await self._run(pipe.execute())
        found = [summary_of(_strs(r)) for r in replies if r]
        return found if sort == "recent" else ranked(found, sort, limit)

    async def session(self, session_id: str, tenant: str | None = None) -> tuple[Summary, list[Step]] | None:
        refs = [(tenant, session_id)] if tenant is not None else await self.find([session_id])
        if not refs:
            return None
        ref = refs[0]
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.summary(ref))
            pipe.lrange(self.keys.steps(ref), 0, -1)
            replies = await self._run(pipe.execute())
        fields, raw = replies[0], replies[1]
        if not fields:
            return None
        summary = summary_of(_strs(fields))
        return summary, numbered([str(s) for s in raw], summary.steps)

    async def set_outcome(self, ref: Ref, outcome: Outcome) -> tuple[Summary, Outcome | None] | None:
        """The summary is read first for the spend and steps the report is given; the write itself checks
        the session still exists (one script), so an expired or unknown session is never written."""
        fields = _strs(await self._run(self._redis.hgetall(self.keys.summary(ref))))
        if not fields:
            return None
        summary = summary_of(fields)
        outcome = replace(outcome, cost_usd=summary.cost_usd, steps=summary.steps, rollout=summary.rollout)
        previous = await self._run(self._set_outcome(keys=[self.keys.summary(ref)],
                                                     args=[outcome.encode(), HISTORY_KEPT]))
        if previous is None:
            return None
        replaced = Outcome.from_dict(json.loads(previous)) if previous else None
        if summary.outcome is not None:
            summary.replaced = [*summary.replaced, summary.outcome][-(HISTORY_KEPT - 1):]
        summary.outcome = outcome
        return summary, replaced

    async def find(self, session_ids: Sequence[str], tenant: str | None = None) -> list[Ref]:
        """One score lookup per tenant and id, in one round trip (never a scan of the sessions); an index entry
        whose session has expired (the index is trimmed only as steps are written) is no session."""
        tenants = [tenant] if tenant is not None else [
            str(t) for t in await self._run(self._redis.zrange(self.keys.tenants(), 0, -1))]
        refs = [(t, sid) for t in tenants for sid in session_ids]
        async with self._redis.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.zscore(self.keys.index(), member(ref))
                pipe.exists(self.keys.summary(ref))
            replies = await self._run(pipe.execute())
        found = [(float(score), ref) for ref, score, alive in zip(refs, replies[::2], replies[1::2], strict=True)
                 if score is not None and alive]
        return [ref for _, ref in sorted(found, reverse=True)]


def _placed(a: Append) -> dict[str, str]:
    """The route and rollout membership of the step, when it has them (a step without keeps the last)."""
    out = {}
    if a.route:
        out["route"] = a.route
    if a.rollout:
        out["ro"] = a.rollout
    return out


def _strs(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in fields.items()}
