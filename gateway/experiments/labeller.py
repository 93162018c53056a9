"""The labeller: turns compared shadow pairs into stored training labels, in the background, bounded.

`offer` runs where a shadow pair was just compared (already off the request path) and only queues the
pair, or drops it (counted) when the queue is full. A worker labels each pair: objective checks, else the
judge when the policy's `labels.judge` names one, else the cheap agreement of the two answers. The judge
is called at most `rate_per_min` times a minute, `max_in_flight` at once, each call within `timeout_s`;
a judge that fails, is late or answers anything but A, B or TIE labels nothing. Prompts are stored only
with the request log's prompt opt-in (AGENT_GATEWAY_REQUEST_LOG_PROMPTS=1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from gateway.apis.chat import wire as chat_wire
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.experiments.shadows import Pair
from gateway.policy.model import Policy
from gateway.rollout import labels as lb
from gateway.rollout.comparison import assemble
from gateway.store.contract import StoreError
from gateway.store.labels import LabelStore
from gateway.telemetry.metrics import Metrics
from gateway.upstream import forward as upstream
from gateway.upstream.client import Pool

log = logging.getLogger(__name__)

JUDGE_HEADER = "x-gateway-judge"
# The judge answers A, B or TIE within its max_tokens; an answer past this many bytes is cut off, unread.
JUDGE_MAX_BODY_BYTES = 1024 * 1024
MINUTE_S = 60.0


class RateWindow:
    """At most `rate` events in any 60 s: the start times of the last minute's events."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._times: deque[float] = deque()

    def allow(self, rate_per_min: float) -> bool:
        now = self._clock()
        while self._times and self._times[0] <= now - MINUTE_S:
            self._times.popleft()
        if len(self._times) >= rate_per_min:
            return False
        self._times.append(now)
        return True


class Labeller:
    """A bounded queue of pairs and the worker that labels them; reads the `labels:` section live."""

    def __init__(
        self,
        client: Pool,
        store: LabelStore,
        metrics: Metrics,
        policy: Callable[[], Policy],
        *,
        prompts: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self._client, self._store, self._policy, self.prompts = client, store, policy, prompts
        self._rng = rng or random.Random()
        self._queue: asyncio.Queue[Pair] = asyncio.Queue()
        self._rate = RateWindow()
        self._busy = 0
        self._room = asyncio.Condition()
        self._worker: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.labels, self.skipped = metrics.labels, metrics.labels_skipped
        self.judge_calls, self.dropped = metrics.judge_calls, metrics.labeller_dropped

    def offer(self, pair: Pair) -> None:
        """Queue a compared pair for labelling; never waits (a full queue drops it, counted)."""
        spec = self._policy().labels
        if spec is None:
            return
        if self._queue.qsize() >= spec.queue:
            self.dropped.inc()
            return
        self._queue.put_nowait(pair)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="labeller")

    async def _run(self) -> None:
        while True:
            pair = await self._queue.get()
            spec = self._policy().labels
            if spec is None:
                continue
            width = spec.judge.max_in_flight if spec.judge is not None else 1
            async with self._room:
                while self._busy >= width:
                    await self._room.wait()
                self._busy += 1
            task = asyncio.get_running_loop().create_task(self._labelled(pair, spec))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _labelled(self, pair: Pair, spec: lb.LabelsSpec) -> None:
        try:
            await self.label(pair, spec)
        except Exception:  # a bug here must not kill the worker; the pair is simply not labelled
            log.exception("labelling pair of %s failed", pair.request_id)
        finally:
            async with self._room:
                self._busy -= 1
                self._room.notify()

    async def label(self, pair: Pair, spec: lb.LabelsSpec) -> dict[str, Any] | None:
        """Label one pair and store it; the label, or None (counted by reason) when the pair gives none."""
        found = lb.sides(pair.record, spec)
        if isinstance(found, lb.Skip):
            self.skipped.labels(found.value).inc()
            return None
        strong, weak = found
        captures = {"primary": pair.primary, "shadow": pair.shadow}
        strong_text, weak_text = (lb.answer_text(assemble(captures[side])) for side in (strong, weak))
        agreement = lb.agreement(strong_text, weak_text)
        verdict, source = lb.checked(pair.record, strong, weak), "checks"
        if verdict is None and spec.judge is not None:
            verdict, source = await self._judge(spec.judge, pair.body, strong_text, weak_text), "judge"
            if verdict is None:
                self.skipped.labels(lb.Skip.JUDGE.value).inc()
                return None
        if verdict is None:
            verdict = lb.Verdict.TIE if agreement.agrees(spec.agree_similarity) else lb.Verdict.WEAK_WORSE
            source = "agreement"
        record = self._record(pair, spec, strong, weak, verdict, source, agreement)
        try:
            await self._store.add_label(json.dumps(record, separators=(",", ":"), default=str), spec.max_labels,
                                        spec.ttl_s)
        except StoreError as exc:
            self.skipped.labels("store_unavailable").inc()
            log.debug("label of %s not kept: %s", pair.request_id, exc)
            return None
        self.labels.labels(verdict.value).inc()
        return record

    def _record(
        self, pair: Pair, spec: lb.LabelsSpec, strong: str, weak: str, verdict: lb.Verdict, source: str,
        agreement: lb.Agreement,
    ) -> dict[str, Any]:
        q_strong, q_weak = lb.qualities(verdict)
        record: dict[str, Any] = {
            "at": round(time.time(), 3),
            "request_id": pair.request_id,
            "target": pair.target,
            "model": pair.record.get("model"),
            "endpoint": pair.features.endpoint if pair.features is not None else None,
            "strong": pair.record[strong].get("deployment"),
            "weak": pair.record[weak].get("deployment"),
            "verdict": verdict.value,
            "good_enough": lb.good_enough(verdict),
            "q_strong": q_strong,
            "q_weak": q_weak,
            "source": source,
            "agreement": agreement.to_dict(),
            "features": None if pair.features is None else pair.features.as_record(with_prompt=self.prompts),
        }
        if self.prompts:
            record["body"] = dict(pair.body)
        return record

    async def _judge(self, spec: lb.JudgeSpec, body: Mapping[str, Any], strong: str, weak: str) -> lb.Verdict | None:
        """Ask the judge which answer is better, in random order; None (counted) when it gives no verdict."""
        if not self._rate.allow(spec.rate_per_min):
            self.judge_calls.labels("rate_limited").inc()
            return None
        strong_first = self._rng.random() < 0.5
        first, second = (strong, weak) if strong_first else (weak, strong)
        messages = lb.judge_messages(lb.request_text(body), first, second)
        reply, result = await self._ask(spec, messages)
        choice = None if reply is None else lb.parse_choice(reply)
        if reply is not None and choice is None:
            result = "unparsed"
        self.judge_calls.labels(result).inc()
        return None if choice is None else lb.unswapped(choice, strong_first)

    async def _ask(self, spec: lb.JudgeSpec, messages: list[dict[str, str]]) -> tuple[str | None, str]:
        """The judge's reply text and the call's result: ok, timeout or error."""
        dep = self._policy().deployments.get(spec.deployment)
        if dep is None:  # a reload removed it; the policy check makes this rare
            return None, "error"
        payload = {"model": dep.served_model, "messages": messages, "max_tokens": spec.max_tokens,
                   "temperature": 0, "stream": False}
        try:
            got = await upstream.fetch(self._client, spec.deployment, dep, chat_wire.PATHS["chat"],
                                       json.dumps(payload).encode(), {JUDGE_HEADER: "1"}, timeout_s=spec.timeout_s,
                                       limit_bytes=JUDGE_MAX_BODY_BYTES)
        except UpstreamTimeout:
            return None, "timeout"
        except GatewayError:
            return None, "error"
        text = _reply_text(got.body) if got.status == 200 else None
        return text, "ok" if text is not None else "error"

    async def close(self) -> None:
        tasks = [t for t in (self._worker, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _reply_text(raw: bytes) -> str | None:
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None
