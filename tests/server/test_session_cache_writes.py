"""The served steps' records are written in batches, in order, by one task at a time, and a store that fails a
batch costs that batch only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gateway.apis.usage import Usage
from gateway.context.prefix import SessionPrefixes
from gateway.decision.call import Call
from gateway.features import extract
from gateway.policy.model import load
from gateway.server.session_caches import SessionCaches
from gateway.store.contract import StoreError
from gateway.store.prefixes import MemoryPrefixStore, Served
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import make_metrics

POLICY = load(Path(__file__).resolve().parents[2] / "policies" / "default.yaml")  # it prices switches


class CountingStore(MemoryPrefixStore):
    """The in-memory store, counting the batches it is handed; `failing` batches raise the store's error."""

    def __init__(self, failing: int = 0) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.failing = failing

    async def served_many(self, steps: Sequence[Served]) -> None:
        self.batches.append(len(steps))
        if self.failing:
            self.failing -= 1
            raise StoreError("the store is down")
        await super().served_many(steps)


def _call(session: str, turns: int) -> Call:
    messages = [{"role": "user", "content": f"task of {session}"}]
    messages += [{"role": "assistant", "content": f"step {n}"} for n in range(turns)]
    body = {"model": "auto", "messages": messages}
    return Call(POLICY, "chat", body, body, 100, extract(body, "chat"), {"x-session-id": session}, None, None)


def _exchange(deployment: str) -> Exchange:
    ex = Exchange("r", "chat", "chat")
    ex.deployment, ex.usage = deployment, Usage(prompt_tokens=1_000)
    return ex


async def _serve(caches: SessionCaches, call: Call, deployment: str) -> None:
    sighting = await caches.sighting(call)
    assert sighting is not None
    caches.served(call, sighting, _exchange(deployment))


async def _record(store: MemoryPrefixStore, session: str) -> SessionPrefixes:
    call = _call(session, 1)
    assert call.session_id is not None
    return await store.prefixes(call.tenant_or_anonymous, call.session_id)


async def test_steps_served_in_one_turn_of_the_loop_are_written_in_one_batch_in_order() -> None:
    store = CountingStore()
    caches = SessionCaches(store, make_metrics())
    calls = [(_call(f"s{n}", 1), "fast") for n in range(5)] + [(_call("s0", 2), "hq")]
    sightings = [await caches.sighting(call) for call, _ in calls]
    for (call, deployment), sighting in zip(calls, sightings, strict=True):
        assert sighting is not None
        caches.served(call, sighting, _exchange(deployment))
    await caches.close()
    assert store.batches == [6]
    first = await _record(store, "s0")
    assert first.home == "hq" and set(first.served) == {"fast", "hq"}  # its second step written after its first
    assert [(await _record(store, f"s{n}")).home for n in range(1, 5)] == ["fast"] * 4


async def test_a_batch_the_store_fails_is_dropped_and_the_next_one_is_written() -> None:
    store = CountingStore(failing=1)
    caches = SessionCaches(store, make_metrics())
    await _serve(caches, _call("s1", 1), "fast")
    await caches.close()
    await _serve(caches, _call("s2", 1), "fast")
    await caches.close()
    assert store.batches == [1, 1]
    assert (await _record(store, "s1")).home is None  # lost with its batch, and logged
    assert (await _record(store, "s2")).home == "fast"
