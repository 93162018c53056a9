"""The JSONL request log `policy simulate` replays: one line's format, buffered in memory, written by a background
task.

The request path only appends a dict to a list; a complexity the decision did not score is scored at the
flush (off the request path), and encoding and the file write happen in a worker thread once per FLUSH_S,
so a slow disk never blocks the event loop. Prompts are left out unless configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.experiments.enrollment import Enrollment, Finish

log = logging.getLogger(__name__)

FLUSH_S = 1.0
BUFFER_MAX = 50_000  # records held between flushes; beyond this they are dropped (and counted)
# Logged besides the headers the policy reads: the session id, which sessions and rollouts key on.
ALWAYS_LOGGED = frozenset({"x-session-id"})
# Never logged, whoever reads it: a name that looks like it carries a credential.
_SECRET_LOOKING = re.compile(r"auth|token|key|secret|passw|cookie|credential|signature|bearer", re.IGNORECASE)


def loggable_headers(headers: Mapping[str, str], wanted: frozenset[str]) -> dict[str, str]:
    """The request's headers named in `wanted` (lower-case: what the policy's rules and rollout keys read)
    or ALWAYS_LOGGED, so a replay sees them; never one whose name looks like a credential."""
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if (low in wanted or low in ALWAYS_LOGGED) and not _SECRET_LOOKING.search(low):
            out[low] = value[:256]
    return out


def log_record(enrollment: Enrollment, finish: Finish, prompts: bool) -> dict[str, Any]:
    """One request's line: what a replay decides from (features, headers, step, complexity) and what happened."""
    ex, call, f, d = enrollment.ex, enrollment.call, enrollment.features, enrollment.decision
    usage, policy = ex.usage, enrollment.policy
    price = policy.deployments[ex.deployment].price if ex.deployment in policy.deployments else None
    record: dict[str, Any] = {
        "at": round(time.time(), 3),
        "request_id": ex.request_id,
        "endpoint": f.endpoint,
        "model": f.requested_model,
        "tenant": call.tenant,
        "headers": loggable_headers(call.headers, policy.read_headers),
        "features": f.as_record(with_prompt=prompts),
        "step": None if call.step is None else dataclasses.asdict(call.step),
        "complexity": enrollment.complexity,
        "decision": {"deployment": d.deployment, "rule": d.rule, "attempts": list(d.attempts)},
        "served_by": ex.deployment,
        "arm": enrollment.cohort.value if enrollment.cohort else None,
        "status": finish.status,
        "usage": None
        if usage is None
        else {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
              "cached_tokens": usage.cached_tokens},
        "cost_usd": None if usage is None or price is None else price.cost_usd_of(usage),
        "latency_ms": round(finish.total_ms, 3),
        "ttft_ms": None if finish.ttft_ms is None else round(finish.ttft_ms, 3),
    }
    if prompts:
        record["body"] = call.body
    return record


class RequestLog:
    """An append-only JSONL file; `write` never blocks, `run` flushes, `close` flushes the rest."""

    def __init__(self, path: str, *, prompts: bool = False) -> None:
        self.path = Path(path)
        self.prompts = prompts
        self._buffer: list[tuple[dict[str, Any], Callable[[], float] | None]] = []
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def write(self, record: dict[str, Any], score: Callable[[], float] | None = None) -> None:
        """Queue a line; `score`, when given, is the line's complexity, worked out at the flush."""
        if len(self._buffer) >= BUFFER_MAX:
            self.dropped += 1
            return
        self._buffer.append((record, score))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="request-log")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        queued, self._buffer = self._buffer, []
        if not queued:
            return
        records = [_scored(record, score) for record, score in queued]
        try:
            await asyncio.to_thread(_append, self.path, records)
        except OSError as exc:
            self.dropped += len(records)
            log.warning("request log %s: %s (%d records dropped)", self.path, exc.strerror, len(records))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()


def _scored(record: dict[str, Any], score: Callable[[], float] | None) -> dict[str, Any]:
    if score is not None:
        record["complexity"] = score()
    return record


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)
