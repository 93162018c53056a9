"""One request's part in the experiments: its arm and cohort, the shadows waiting for the forward, the primary's
capture, and how the request ended (`Finish`, worked out once for the arm, the mirror and the request log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.agents.pending_steps import Cohorted
from gateway.decision.call import Call
from gateway.decision.routing import Decision
from gateway.errors import CLIENT_CLOSED
from gateway.features import Features
from gateway.policy.model import Policy
from gateway.rollout.comparison import Capture
from gateway.rollout.samples import Cohort
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.telemetry.exchange import Exchange


class Enrollment:
    """One request's part in the experiments: its arm, cohort and shadow rendezvous."""

    __slots__ = ("as_sent", "call", "candidate_deployment", "cohort", "complexity", "decision", "ex", "forwarded",
                 "future", "shadows", "spec", "state")

    def __init__(self, ex: Exchange, call: Call, decision: Decision, complexity: float | None = None,
                 as_sent: dict[str, Any] | None = None) -> None:
        self.ex, self.call, self.decision = ex, call, decision
        self.as_sent = as_sent  # the body before the policy's context rules, when they are on
        self.complexity = complexity  # the live decision's score, if it read one
        self.spec: RolloutSpec | None = None
        self.state: RolloutState | None = None
        self.cohort: Cohort | None = None
        self.candidate_deployment: str | None = None
        self.future: asyncio.Future[Capture] | None = None
        self.shadows: list[Callable[[], bool]] = []  # started once the call passes admission to a deployment
        self.forwarded = False

    def measure(self, spec: RolloutSpec, state: RolloutState, cohort: Cohort) -> None:
        self.spec, self.state, self.cohort = spec, state, cohort

    def cohorted(self) -> Cohorted | None:
        """The measured cohort, for the agent step's process counters; None outside one."""
        if self.spec is None or self.state is None or self.cohort is None:
            return None
        return Cohorted(self.spec.route or "", self.spec, self.state, self.cohort)

    def primary(self) -> asyncio.Future[Capture]:
        """The primary's capture, resolved when the client's response ends; the relay starts copying bytes."""
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()
            self.ex.tap = []
        return self.future

    @property
    def policy(self) -> Policy:
        return self.call.policy

    @property
    def features(self) -> Features:
        return self.call.features

    def sent(self) -> None:
        """The call is past the budget hold, on its way to a deployment: its shadows start now, so a call refused
        there is neither shadowed nor sampled."""
        self.forwarded = True
        for start in self.shadows:
            start()
        self.shadows.clear()


@dataclass(frozen=True, slots=True)
class Finish:
    """How an enrolled request ended, as the client saw it."""

    status: int
    total_ms: float
    ttft_ms: float | None
    # Only a call a deployment served is a sample or a pair: not one refused before the forward (429, 503),
    # not a 4xx (the request's own fault), not one whose client left.
    served: bool

    @classmethod
    def of(cls, enrollment: Enrollment, status: int) -> Finish:
        ex = enrollment.ex
        total_ms = (time.perf_counter() - ex.started) * 1000
        ttft_ms = None if ex.first_byte_at is None else (ex.first_byte_at - ex.started) * 1000
        served = enrollment.forwarded and status != CLIENT_CLOSED and not 400 <= status < 500
        return cls(status, total_ms, ttft_ms, served)
