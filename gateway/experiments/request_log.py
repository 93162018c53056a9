"""The JSONL request log `policy simulate` replays: buffered in memory, written by a background task.

The request path only appends a dict to a list; encoding and the file write happen in a worker thread
once per FLUSH_S, so a slow disk never blocks the event loop. Prompts are left out unless configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


class RequestLog:
    """An append-only JSONL file; `write` never blocks, `run` flushes, `close` flushes the rest."""

    def __init__(self, path: str, *, prompts: bool = False) -> None:
        self.path = Path(path)
        self.prompts = prompts
        self._buffer: list[dict[str, Any]] = []
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def write(self, record: dict[str, Any]) -> None:
        if len(self._buffer) >= BUFFER_MAX:
            self.dropped += 1
            return
        self._buffer.append(record)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="request-log")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        records, self._buffer = self._buffer, []
        if not records:
            return
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


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)
