"""A Deadline expires once when its time passes while set, never when cleared, and arms few timers."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from gateway.upstream.deadline import Deadline
from tests.fixtures.conditions import until
from tests.fixtures.timers import armed_timers


def _on(loop_factory: Callable[[], asyncio.AbstractEventLoop], test: Callable[[], Any]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(test())


LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio"), pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_it_expires_once_after_its_time(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        deadline = Deadline(loop, lambda: fired.append(loop.time()))
        at = loop.time() + 0.05
        deadline.set_at(at)
        assert deadline.pending
        await until(lambda: fired, what="the deadline expired")
        assert fired[0] >= at - 0.001 and not deadline.pending
        await until(lambda: deadline._timer is None)
        assert len(fired) == 1
    _on(loop_factory, test)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_deadline_moved_later_expires_at_the_later_time(loop_factory: Callable[[], asyncio.AbstractEventLoop]
                                                           ) -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        deadline = Deadline(loop, lambda: fired.append(loop.time()))
        deadline.set_at(loop.time() + 0.02)
        later = loop.time() + 0.3
        deadline.set_at(later)  # the timer armed for the first stays; it re-arms when it fires early
        await until(lambda: fired, what="the deadline expired")
        assert fired[0] >= later - 0.001
    _on(loop_factory, test)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_deadline_moved_earlier_expires_at_the_earlier_time(loop_factory: Callable[[], asyncio.AbstractEventLoop]
                                                               ) -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        deadline = Deadline(loop, lambda: fired.append(loop.time()))
        deadline.set_at(loop.time() + 60)
        deadline.set_at(loop.time() + 0.05)
        await until(lambda: fired, timeout_s=10, what="the earlier deadline expired")
    _on(loop_factory, test)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_cleared_or_cancelled_deadline_never_expires(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        cleared = Deadline(loop, lambda: fired.append("cleared"))
        cleared.set_at(loop.time() + 0.02)
        cleared.clear()
        cancelled = Deadline(loop, lambda: fired.append("cancelled"))
        cancelled.set_at(loop.time() + 0.02)
        cancelled.cancel()
        assert cancelled._timer is None
        await until(lambda: cleared._timer is None, what="the cleared deadline's timer ran")
        assert fired == []
    _on(loop_factory, test)


def test_a_thousand_waits_on_one_connection_arm_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.new_event_loop()
    armed = armed_timers(loop, monkeypatch)

    async def test() -> None:
        deadline = Deadline(loop, lambda: None)
        for _ in range(1000):  # a keep-alive connection's waits: a deadline each, cleared when bytes came
            deadline.set_at(loop.time() + 30.0)
            await asyncio.sleep(0)
            deadline.clear()
        deadline.cancel()

    _on(lambda: loop, test)
    assert armed == ["Deadline._fire"]


def test_a_cancelled_deadline_lets_its_owner_go_without_the_cyclic_collector() -> None:
    """The owner holds its deadline and the deadline the owner's bound method: cancelled (the owner is done),
    the deadline drops it, so the pair is freed by reference counting, not at the collector's next full pass."""
    class Owner:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.deadline = Deadline(loop, self.expired)

        def expired(self) -> None:
            raise AssertionError("a cancelled deadline expired")

    async def test() -> None:
        owner = Owner(asyncio.get_running_loop())
        owner.deadline.set_at(asyncio.get_running_loop().time() + 60)
        owner.deadline.cancel()
        freed = weakref.ref(owner)
        del owner
        assert freed() is None

    gc.disable()
    try:
        _on(uvloop.new_event_loop, test)
    finally:
        gc.enable()
