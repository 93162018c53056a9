"""The health and load figures the workers of one `serve --workers N` share: each posts its own to a small file.

One worker probes the deployments (the lowest-numbered one still posting); the others take its probes
instead of probing on their own. Every worker posts the requests it has in flight and the consecutive
failures it has seen, and each adds the others' to its own, so ejection and `max_in_flight` count the
whole server's traffic, not a worker's share of it. Files are replaced atomically; a posting older than
STALE_S is a worker that has ended or hangs, and is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POST_S = 0.25  # how often a worker posts its figures and reads the others'
STALE_S = 2.0


@dataclass(frozen=True, slots=True)
class Probe:
    """What the probing worker last saw of one deployment (its /health check and its /metrics scrape)."""

    ok: bool
    requests_waiting: float
    requests_running: float
    kv_cache_usage: float
    spec_decode: tuple[float, float, float] | None  # drafts, draft tokens, accepted tokens (vLLM's counts)
    at: float  # wall clock of the last /health check


@dataclass(slots=True)
class Posting:
    """One worker's figures; `ejected_until` is wall-clock time (monotonic clocks differ between processes)."""

    worker: int
    pid: int
    at: float
    probes: dict[str, Probe] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    ejected_until: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Posting:
        raw: dict[str, Any] = json.loads(text)
        raw["probes"] = {name: Probe(**{**probe, "spec_decode": _counts(probe.get("spec_decode"))})
                         for name, probe in raw.get("probes", {}).items()}
        return cls(**raw)


@dataclass(slots=True)
class Others:
    """The other workers' postings added up, as this worker last read them."""

    prober: int  # the worker whose probes everyone uses
    probes: dict[str, Probe] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    ejected_until: dict[str, float] = field(default_factory=dict)


class Board:
    """The folder of postings of one server run (created by `serve --workers N`, removed when it stops)."""

    def __init__(self, directory: str | Path, worker: int) -> None:
        self.directory = Path(directory)
        self.worker = worker
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path = self.directory / f"worker-{worker}.json"
        self._tmp = self.directory / f".worker-{worker}.json.tmp"

    def post(self, posting: Posting) -> None:
        self._tmp.write_text(posting.to_json())
        os.replace(self._tmp, self._path)

    def withdraw(self) -> None:
        """Remove this worker's posting (it stops), so the others need not wait for it to go stale."""
        self._path.unlink(missing_ok=True)

    def read(self) -> Others:
        """The fresh postings of the other workers, added up; the prober is the lowest worker posting."""
        now = time.time()
        fresh = [p for p in self._postings() if p.worker != self.worker and now - p.at < STALE_S]
        prober = min([self.worker, *(p.worker for p in fresh)])
        others = Others(prober)
        for posting in fresh:
            if posting.worker == prober:
                others.probes = posting.probes
            _add(others.in_flight, posting.in_flight)
            _add(others.failures, posting.failures)
            for name, until in posting.ejected_until.items():
                others.ejected_until[name] = max(until, others.ejected_until.get(name, 0.0))
        return others

    def _postings(self) -> list[Posting]:
        found = []
        for path in self.directory.glob("worker-*.json"):
            try:
                found.append(Posting.from_json(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:  # a worker's file removed or from another version
                log.debug("skipping posting %s: %s", path, exc)
        return found


def _counts(raw: Any) -> tuple[float, float, float] | None:
    return None if raw is None else (float(raw[0]), float(raw[1]), float(raw[2]))


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for name, count in more.items():
        total[name] = total.get(name, 0) + count
