"""Health and load of each deployment: active /health checks, /metrics scrapes and passive ejection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.apis import json_body
from gateway.decision.routing import DeploymentLoad
from gateway.errors import GatewayError
from gateway.policy.model import Deployment, Policy
from gateway.upstream import forward as upstream
from gateway.upstream.board import POST_S, Board, Others, Posting, Probe
from gateway.upstream.client import Pool

log = logging.getLogger(__name__)

# vLLM's Prometheus names (with the `vllm:` prefix) for the load figures the policy can use.
VLLM_GAUGES = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
}
# vLLM's speculative-decoding counters (v1 engine); only a deployment that speculates has them.
VLLM_SPEC_DECODE = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


@dataclass(frozen=True, slots=True)
class SpecDecode:
    """A speculating deployment's counts since its vLLM started, as vLLM reports them."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    @property
    def acceptance_ratio(self) -> float | None:
        """Accepted / drafted tokens; None until the proposer has drafted any."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass(slots=True)
class Tracked:
    """Mutable bookkeeping for one deployment; routing only ever sees the frozen DeploymentLoad."""

    deployment: Deployment
    load: DeploymentLoad
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    probe_ok: bool = True
    probed_at: float = 0.0  # wall clock of the last /health check (this worker's or the prober's)
    spec_decode: SpecDecode | None = None
    window: int | None = None  # the context window the deployment reports (vLLM's max_model_len)
    window_due: bool = True  # (re)read the window: at the start, and when the deployment passes checks again


# Where vLLM names its context window: each model object of GET /v1/models.
MODELS_PATH = "/v1/models"


def window_in(models: Any, served_model: str) -> int | None:
    """The served model's `max_model_len` in a /v1/models answer (the only model's when none has that id)."""
    data = models.get("data") if isinstance(models, dict) else None
    found = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    named = [m for m in found if m.get("id") == served_model] or (found if len(found) == 1 else [])
    window = named[0].get("max_model_len") if named else None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


# Ratios, one per engine: the deployment's figure is their mean (the share of its whole KV cache in use,
# engines being the same size). Counts (requests, spec-decode tokens) add up across engines.
_MEAN_SERIES = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})


def parse_metrics(text: str) -> dict[str, float]:
    """The vLLM series we use, over all label sets (one engine or several): ratios averaged, counts summed."""
    wanted = {*VLLM_GAUGES, *VLLM_SPEC_DECODE}
    totals: dict[str, float] = {}
    samples: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:name_end]
        if name in wanted:
            with contextlib.suppress(ValueError, IndexError):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                samples[name] = samples.get(name, 0) + 1
    for name in _MEAN_SERIES & totals.keys():
        totals[name] /= samples[name]
    return totals


class Deployments:
    """Keeps a current DeploymentLoad per deployment and counts in-flight requests; with a Board, one of
    several workers probes and all of them count the whole server's failures and requests in flight."""

    def __init__(
        self, client: Pool, on_change: Callable[[str, Tracked], None] | None = None, board: Board | None = None
    ):
        self._client = client
        self._tracked: dict[str, Tracked] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._on_change = on_change
        self.in_flight: dict[str, int] = {}  # this worker's
        self.load: dict[str, DeploymentLoad] = {}
        self.windows: dict[str, int] = {}  # each deployment's context window, as it reports it
        self.board = board
        self._others = Others(prober=0) if board is None else board.read()
        self._sharing = None if board is None else asyncio.get_running_loop().create_task(self._share())

    @property
    def probing(self) -> bool:
        """Whether this worker checks the deployments itself (always, unless it shares a Board)."""
        return self.board is None or self._others.prober == self.board.worker

    @property
    def prober(self) -> int:
        return self._others.prober

    def failures(self, name: str) -> int:
        """Consecutive failures of a deployment seen by this worker and (as last posted) the others."""
        tracked = self._tracked.get(name)
        return (0 if tracked is None else tracked.consecutive_failures) + self._others.failures.get(name, 0)

    def sending(self, name: str) -> _Sending:
        """`with deployments.sending(name):` counts a call in flight on the deployment while it lasts."""
        return _Sending(self.in_flight, name)

    def in_flight_now(self) -> dict[str, int]:
        """Requests in flight per deployment across the whole server (the other workers' as last posted)."""
        others = self._others.in_flight
        if not others:
            return dict(self.in_flight)
        return {name: count + others.get(name, 0) for name, count in self.in_flight.items()}

    def reconcile(self, policy: Policy) -> None:
        """Follow a (re)loaded policy: start watching new deployments, stop watching removed ones."""
        for name, dep in policy.deployments.items():
            known = self._tracked.get(name)
            if known is not None and known.deployment == dep:
                continue
            self._stop(name)
            self._tracked[name] = Tracked(dep, known.load if known else DeploymentLoad())
            self.windows.pop(name, None)  # read again from the deployment as the policy now describes it
            self.in_flight.setdefault(name, 0)
            self._tasks[name] = asyncio.get_running_loop().create_task(self._watch(name), name=f"watch-{name}")
        for name in set(self._tracked) - set(policy.deployments):
            self._stop(name)
            del self._tracked[name]
            self.load.pop(name, None)
            self.windows.pop(name, None)
        self._publish_all()

    def _stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._sharing] if self._sharing is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self.board is not None:
            self.board.withdraw()

    def tracked(self, name: str) -> Tracked | None:
        return self._tracked.get(name)

    # Passive health: what real requests observe.
    def record_success(self, name: str) -> None:
        tracked = self._tracked.get(name)
        if tracked is not None and tracked.consecutive_failures:
            tracked.consecutive_failures = 0
            self._publish(name)

    def record_failure(self, name: str) -> None:
        tracked = self._tracked.get(name)
        if tracked is None:
            return
        tracked.consecutive_failures += 1
        health = tracked.deployment.health
        seen = tracked.consecutive_failures + self._others.failures.get(name, 0)  # other workers' too
        if seen >= health.eject_after_failures:
            tracked.ejected_until = time.monotonic() + health.cooldown_s
            log.warning("deployment %s ejected for %.1fs after %d consecutive failures",
                        name, health.cooldown_s, seen)
        self._publish(name)

    def _publish_all(self) -> None:
        for name in self._tracked:
            self._publish(name)

    def _publish(self, name: str) -> None:
        tracked = self._tracked[name]
        healthy = tracked.probe_ok and time.monotonic() >= tracked.ejected_until
        tracked.load = replace(tracked.load, healthy=healthy)
        self.load[name] = tracked.load
        if tracked.window is not None:
            self.windows[name] = tracked.window
        if self._on_change is not None:
            self._on_change(name, tracked)

    async def _watch(self, name: str) -> None:
        """Probe /health, scrape /metrics and read the window; an ejection ends at the first good probe after its
        cool-down."""
        tracked = self._tracked[name]
        dep = tracked.deployment
        period_s = min(dep.health.interval_s, dep.load.scrape_interval_s)
        next_probe = 0.0
        while True:
            if self.probing:  # else the prober's figures arrive through the board
                now = time.monotonic()
                if now >= next_probe:
                    await self._probe(name, tracked)
                    next_probe = now + dep.health.interval_s
                if tracked.probe_ok:
                    await self._scrape(name, tracked)
            if tracked.window_due and tracked.probe_ok:  # every worker reads it: it is needed per request
                await self._learn_window(name, tracked)
            if self.probing:
                self._publish(name)
            await asyncio.sleep(period_s)

    async def _probe(self, name: str, tracked: Tracked) -> None:
        dep = tracked.deployment
        try:
            status, _ = await upstream.get(self._client, dep.url + dep.health.path, dep.health.timeout_s)
            ok = status == 200
        except GatewayError:
            ok = False
        if ok != tracked.probe_ok:
            log.warning("deployment %s health check %s", name, "passes again" if ok else "fails")
            tracked.window_due = tracked.window_due or ok  # a restarted deployment may serve another window
        tracked.probe_ok, tracked.probed_at = ok, time.time()
        if ok and time.monotonic() >= tracked.ejected_until:
            tracked.consecutive_failures = 0

    async def _scrape(self, name: str, tracked: Tracked) -> None:
        dep = tracked.deployment
        try:
            status, raw = await upstream.get(self._client, dep.url + dep.load.metrics_path, dep.health.timeout_s)
        except GatewayError:
            return
        if status != 200:
            return
        figures = parse_metrics(raw.decode("utf-8", "replace"))
        fields = {VLLM_GAUGES[k]: v for k, v in figures.items() if k in VLLM_GAUGES}
        tracked.load = replace(tracked.load, **fields)  # type: ignore[arg-type]  # every field named is a float
        counts = {VLLM_SPEC_DECODE[k]: v for k, v in figures.items() if k in VLLM_SPEC_DECODE}
        if counts:
            tracked.spec_decode = SpecDecode(**counts)

    async def _learn_window(self, name: str, tracked: Tracked) -> None:
        """Read the deployment's context window from its model list; an answer without one leaves the policy's
        `max_model_len` (or none) in force, and is not asked again until the deployment restarts."""
        dep = tracked.deployment
        try:
            status, raw = await upstream.get(self._client, dep.url + MODELS_PATH, dep.health.timeout_s)
        except GatewayError:
            return  # unreachable now: asked again next period
        if status != 200:
            return
        tracked.window_due = False
        window = window_in(json_body.response_object(raw), dep.served_model)
        if window is not None and window != tracked.window:
            log.info("deployment %s serves a context window of %d tokens", name, window)
            if dep.max_model_len is not None and dep.max_model_len > window:
                log.warning("deployment %s: the policy's max_model_len %d is more than the %d it serves; %d is used",
                            name, dep.max_model_len, window, window)
        tracked.window = window
        if window is None:
            self.windows.pop(name, None)
        else:
            self.windows[name] = window

    # Sharing with the other workers of one server (only with a Board).
    async def _share(self) -> None:
        assert self.board is not None
        while True:
            try:
                self.board.post(self._posting())
                self._adopt(self.board.read())
            except OSError as exc:
                log.warning("sharing health and load with the other workers failed: %s", exc)
            await asyncio.sleep(POST_S)

    def _posting(self) -> Posting:
        assert self.board is not None
        now, wall = time.monotonic(), time.time()
        posting = Posting(self.board.worker, os.getpid(), wall, in_flight=dict(self.in_flight))
        for name, t in self._tracked.items():
            if self.probing:
                spec = None if t.spec_decode is None else (t.spec_decode.drafts, t.spec_decode.draft_tokens,
                                                           t.spec_decode.accepted_tokens)
                posting.probes[name] = Probe(t.probe_ok, t.load.requests_waiting, t.load.requests_running,
                                             t.load.kv_cache_usage, spec, t.probed_at)
            if t.consecutive_failures:
                posting.failures[name] = t.consecutive_failures
            if t.ejected_until > now:
                posting.ejected_until[name] = wall + t.ejected_until - now
        return posting

    def _adopt(self, others: Others) -> None:
        """Take the prober's figures and any worker's ejection; then publish the result."""
        self._others = others
        now, wall = time.monotonic(), time.time()
        for name, tracked in self._tracked.items():
            until = others.ejected_until.get(name, 0.0)
            if until > wall:
                tracked.ejected_until = max(tracked.ejected_until, now + until - wall)
            probe = None if self.probing else others.probes.get(name)
            if probe is not None:
                _take(tracked, probe, now)
        self._publish_all()


def _take(tracked: Tracked, probe: Probe, now: float) -> None:
    """The prober's view of a deployment; its passing check after the cool-down ends an ejection here too."""
    if probe.ok and probe.at > tracked.probed_at and now >= tracked.ejected_until:
        tracked.consecutive_failures = 0
    tracked.probe_ok, tracked.probed_at = probe.ok, probe.at
    tracked.spec_decode = None if probe.spec_decode is None else SpecDecode(*probe.spec_decode)
    tracked.load = replace(tracked.load, requests_waiting=probe.requests_waiting,
                           requests_running=probe.requests_running, kv_cache_usage=probe.kv_cache_usage)


class _Sending:
    """One call in flight on a deployment, for as long as its `with` block lasts."""

    __slots__ = ("counts", "name")

    def __init__(self, counts: dict[str, int], name: str) -> None:
        self.counts, self.name = counts, name

    def __enter__(self) -> None:
        self.counts[self.name] = self.counts.get(self.name, 0) + 1

    def __exit__(self, *_: object) -> None:
        self.counts[self.name] -= 1
