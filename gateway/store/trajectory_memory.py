"""The in-process twin of RedisTrajectoryStore: the same contract over dicts, for one process without Redis.

Each method runs without awaiting, so on one event loop it is as atomic as the Redis MULTI/EXEC.
tests/store/test_trajectories.py runs one behavioural table against both.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gateway.agents.outcomes import HISTORY_KEPT, Outcome
from gateway.agents.spikes import bucket
from gateway.agents.trajectory import RANKED_SCAN, Step, Summary, ranked
from gateway.policy.agents import Recording
from gateway.store.trajectories import Active, Append, Ref, SessionRecord, SpendSeries, fair_evictions


@dataclass(slots=True)
class _Session:
    summary: Summary
    steps: deque[Step]
    active: Active = field(default_factory=dict)
    spend: dict[int, float] = field(default_factory=dict)


class MemoryTrajectoryStore:
    """Sessions in least-recently-active order, all of them and per tenant, each with a bounded deque of
    steps; expired on access; beyond max_sessions the largest tenant's least recent session goes first."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._sessions: OrderedDict[Ref, _Session] = OrderedDict()
        self._tenants: dict[str, OrderedDict[str, _Session]] = {}  # tenant -> its sessions, least recent first
        self._spend: dict[str, SpendSeries] = {}
        self._ttl_s = float(Recording().ttl_s)
        self._clock = clock

    async def read(self, refs: Sequence[Ref], count: int) -> dict[Ref, SessionRecord]:
        out = {}
        for ref in refs:
            found = self._get(ref)
            if found is None:
                out[ref] = SessionRecord()
                continue
            s = found.summary
            steps = list(found.steps)[-count:] if found.steps else []
            spend = SpendSeries(s.started_at, dict(found.spend))
            out[ref] = SessionRecord(s.steps, s.started_at, s.last_at, steps, dict(found.active), spend)
        return out

    async def tenant_spend(self, tenants: Sequence[str]) -> dict[str, SpendSeries]:
        return {t: _copy_spend(self._spend.get(t, SpendSeries())) for t in tenants}

    async def append(
        self, appends: Sequence[Append], tenant_forget: Mapping[str, Sequence[int]], limits: Recording
    ) -> None:
        self._ttl_s = float(limits.ttl_s)
        for a in appends:
            self._append(a, limits)
        for tenant, old in tenant_forget.items():
            buckets = self._spend[tenant].buckets if tenant in self._spend else {}
            for b in old:
                buckets.pop(b, None)
        self._expire()
        over = len(self._sessions) - limits.max_sessions
        if over > 0:
            sizes = {tenant: len(sessions) for tenant, sessions in self._tenants.items()}
            for tenant, count in fair_evictions(sizes, over).items():
                for session_id in list(itertools.islice(self._tenants[tenant], count)):
                    self._forget((tenant, session_id))

    def _append(self, a: Append, limits: Recording) -> None:
        ref, step = (a.tenant, a.session_id), a.step
        found = self._get(ref)
        if found is None or found.steps.maxlen != limits.max_steps_per_session:
            steps = deque(found.steps if found else (), maxlen=limits.max_steps_per_session)
            found = found or _Session(Summary(a.session_id, a.tenant, started_at=step.at), steps)
            found.steps = steps
            self._sessions[ref] = self._tenants.setdefault(a.tenant, OrderedDict())[a.session_id] = found
        self._sessions.move_to_end(ref)
        self._tenants[a.tenant].move_to_end(a.session_id)
        s = found.summary
        s.steps += 1
        step.step = s.steps
        found.steps.append(step)
        s.cost_usd += step.cost_usd
        s.tokens_in += step.tokens_in
        s.tokens_out += step.tokens_out
        s.last_at, s.steps_per_min = step.at, a.steps_per_min
        s.deployments[step.deployment] = s.deployments.get(step.deployment, 0) + 1
        s.route = a.route or s.route
        s.rollout = a.rollout or s.rollout
        for flag in a.raised:
            if flag not in s.flags:
                s.flags.append(flag)
        for flag in a.cleared:
            found.active.pop(flag, None)
        found.active.update(a.active)
        for b in a.forget:
            found.spend.pop(b, None)
        if step.cost_usd:
            index = bucket(step.at)
            found.spend[index] = found.spend.get(index, 0.0) + step.cost_usd
            series = self._spend.setdefault(a.tenant, SpendSeries(step.at))
            series.buckets[index] = series.buckets.get(index, 0.0) + step.cost_usd

    async def active(self, ref: Ref) -> Active:
        found = self._sessions.get(ref)  # no expiry check here: the request path only reads
        return found.active if found is not None else {}

    async def sessions(self, tenant: str | None, limit: int, sort: str = "recent") -> list[Summary]:
        """Copies only the sessions it returns: the most recent `limit`, or the top `limit` by `sort` among
        the RANKED_SCAN most recent (a view ranked in place: O(limit) or O(RANKED_SCAN), never O(sessions))."""
        self._expire()
        recent = (s.summary for s in self._recent(tenant))
        if sort == "recent":
            return [_copy(s) for s in itertools.islice(recent, limit)]
        return [_copy(s) for s in ranked(itertools.islice(recent, RANKED_SCAN), sort, limit)]

    async def find(self, session_ids: Sequence[str], tenant: str | None = None) -> list[Ref]:
        """The recorded sessions of any of these ids, in the tenant or any tenant, most recently active first."""
        self._expire()
        tenants = [tenant] if tenant is not None else list(self._tenants)
        found = [(s.summary.last_at, (t, sid)) for t in tenants if t in self._tenants for sid in session_ids
                 if (s := self._tenants[t].get(sid)) is not None]
        return [ref for _, ref in sorted(found, reverse=True)]

    async def session(self, session_id: str, tenant: str | None = None) -> tuple[Summary, list[Step]] | None:
        """One session by (tenant, id); without a tenant, the most recent of any tenant's (one lookup each)."""
        refs = await self.find([session_id], tenant)
        if not refs:
            return None
        latest = self._sessions[refs[0]]
        return _copy(latest.summary), list(latest.steps)

    async def set_outcome(self, ref: Ref, outcome: Outcome) -> tuple[Summary, Outcome | None] | None:
        found = self._get(ref)
        if found is None:
            return None
        s = found.summary
        replaced = s.outcome
        if replaced is not None:
            s.replaced = [*s.replaced, replaced][-(HISTORY_KEPT - 1):]
        s.outcome = replace(outcome, cost_usd=s.cost_usd, steps=s.steps, rollout=s.rollout)
        return _copy(s), replaced

    async def close(self) -> None:
        return None

    def _recent(self, tenant: str | None) -> Iterator[_Session]:
        """Sessions (all, or one tenant's), most recently active first, as a view: nothing is copied."""
        if tenant is None:
            return reversed(self._sessions.values())
        return reversed(self._tenants[tenant].values()) if tenant in self._tenants else iter(())

    def _get(self, ref: Ref) -> _Session | None:
        found = self._sessions.get(ref)
        if found is not None and found.summary.last_at + self._ttl_s <= self._clock():
            self._forget(ref)
            return None
        return found

    def _forget(self, ref: Ref) -> None:
        del self._sessions[ref]
        sessions = self._tenants[ref[0]]
        del sessions[ref[1]]
        if not sessions:
            del self._tenants[ref[0]]

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._sessions:
            ref, oldest = next(iter(self._sessions.items()))
            if oldest.summary.last_at > cutoff:
                break
            self._forget(ref)


def _copy(summary: Summary) -> Summary:
    return Summary(summary.session_id, summary.tenant, summary.steps, summary.cost_usd, summary.tokens_in,
                   summary.tokens_out, summary.started_at, summary.last_at, summary.steps_per_min,
                   dict(summary.deployments), list(summary.flags), summary.route, summary.rollout,
                   summary.outcome, list(summary.replaced))


def _copy_spend(series: SpendSeries) -> SpendSeries:
    return SpendSeries(series.since, dict(series.buckets))
