"""Each rollout cohort's counters: counted in memory, written in batches, read back as the guards' observations."""

from __future__ import annotations

from gateway.experiments.rollout_counters import RolloutCounters
from gateway.rollout.samples import Cohort, PairOutcome, Sample
from gateway.rollout.step import start
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.store.rollouts import RolloutKeys
from tests.fixtures.rollout_scripts import spec_of

SPEC = spec_of("{steps: [{set_weight: 50}]}", id="r1", route="hq")


async def _no_errors(route: str, spec: object, totals: dict[str, int]) -> None:
    raise AssertionError("no candidate errors were counted")


async def test_counts_are_batched_until_the_flush_and_then_observed() -> None:
    store, state = MemoryRolloutStore(), start("r1", 1.0)
    counters = RolloutCounters(store, RolloutKeys("ag"))
    for _ in range(3):
        counters.record("hq", SPEC, state, Cohort.CANDIDATE, Sample(False, 10, 50.0, 5.0))
    counters.record("hq", SPEC, state, Cohort.CONTROL, Sample(False, 10, 40.0, 4.0))
    counters.record_outcome(counters.samples_key(state), PairOutcome.WIN)
    assert (await counters.observe(state)).candidate.requests == 0  # nothing written before the flush
    await counters.flush(_no_errors)
    obs = await counters.observe(state)
    assert (obs.candidate.requests, obs.control.requests) == (3, 1)
    assert (await store.counts(counters.samples_key(state))).get("shadow.win") == 1


async def test_a_batch_with_candidate_errors_is_handed_on_with_its_totals() -> None:
    store, state = MemoryRolloutStore(), start("r1", 1.0)
    counters = RolloutCounters(store, RolloutKeys("ag"))
    seen: list[tuple[str, dict[str, int]]] = []

    async def on_errors(route: str, spec: object, totals: dict[str, int]) -> None:
        seen.append((route, totals))

    counters.record("hq", SPEC, state, Cohort.CANDIDATE, Sample(True, 10, 50.0, None))
    await counters.flush(on_errors)
    counters.record("hq", SPEC, state, Cohort.CANDIDATE, Sample(True, 10, 50.0, None))
    await counters.flush(on_errors)
    assert seen[-1][0] == "hq" and seen[-1][1]["candidate.errors"] == 2  # the totals, not the batch


async def test_an_outcome_counts_in_the_window_its_session_was_measured_in() -> None:
    store = MemoryRolloutStore()
    counters = RolloutCounters(store, RolloutKeys("ag"))
    counters.count_outcome("r1", 0, 3, {"candidate.sessions": 1})
    counters.count_outcome("r1", 0, 3, {"candidate.sessions": -1, "candidate.successes": 1})
    await counters.flush(_no_errors)
    assert await store.counts("ag:ro:n:r1:0:3") == {"candidate.sessions": 0, "candidate.successes": 1}
