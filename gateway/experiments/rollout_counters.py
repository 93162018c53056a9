"""Each rollout cohort's outcome counters: counted in memory by the request path, the trajectory flusher and the
shadows, written to the store in batches (`flush`), and read back as the guards' observations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

from gateway.rollout.samples import (
    Cohort,
    Observations,
    PairOutcome,
    ProcessSample,
    Sample,
    counter_fields,
    pair_field,
    process_fields,
)
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.store.rollouts import RolloutKeys, RolloutStore

SAMPLES_TTL_S = 7 * 86400

# Told the totals of a batch that counted candidate errors, with the route and spec they were counted for.
OnErrors = Callable[[str, RolloutSpec, dict[str, int]], Awaitable[None]]


class RolloutCounters:
    """Pending counts by samples key (one cohort pair's window), and the last route and spec of each."""

    def __init__(self, store: RolloutStore, keys: RolloutKeys) -> None:
        self._store, self.keys = store, keys
        self._pending: dict[str, Counter[str]] = {}
        self._specs: dict[str, tuple[str, RolloutSpec]] = {}  # samples key -> (route, spec), for aborts

    def samples_key(self, state: RolloutState) -> str:
        return self.keys.samples(state.rollout_id, state.run, state.window)

    def record(self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: Sample) -> None:
        """Count one served request into its cohort."""
        pending = self._batch(route, spec, state)
        for name in counter_fields(cohort, sample):
            pending[name] += 1

    def record_process(
        self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: ProcessSample
    ) -> None:
        """Count one agent step's process facts into its cohort (from the trajectory flusher)."""
        fields = process_fields(cohort, sample)
        if fields:
            self._batch(route, spec, state).update(fields)

    def count_outcome(self, rollout_id: str, run: int, window: int, fields: dict[str, int]) -> None:
        """Add (or take back) one agent session's outcome counters in the window its steps were measured in."""
        self._pending.setdefault(self.keys.samples(rollout_id, run, window), Counter()).update(fields)

    def record_outcome(self, samples_key: str, outcome: PairOutcome) -> None:
        """Count one shadow pair's comparison into the window it was mirrored in."""
        self._pending.setdefault(samples_key, Counter())[pair_field(outcome)] += 1

    async def observe(self, state: RolloutState) -> Observations:
        return Observations.from_counts(await self._store.counts(self.samples_key(state)))

    async def flush(self, on_errors: OnErrors) -> None:
        """Write the batched counters; a batch that counted candidate errors is passed on with its new totals
        (the instant abort judges them)."""
        pending, self._pending = self._pending, {}
        for key, fields in pending.items():
            totals = await self._store.count(key, fields, SAMPLES_TTL_S)
            if "candidate.errors" in totals and key in self._specs:
                route, spec = self._specs[key]
                await on_errors(route, spec, totals)

    def _batch(self, route: str, spec: RolloutSpec, state: RolloutState) -> Counter[str]:
        key = self.samples_key(state)
        self._specs[key] = (route, spec)
        return self._pending.setdefault(key, Counter())
