"""A connection's deadline, moved and cleared many times a second for the price of a float.

With uvloop, a timer armed and cancelled is not cheap (a libuv handle opened and closed: docs/performance.md,
'Why the code is shaped so'), and the gateway armed three a request: the upstream response's head and body waits
and the client's request-head timeout. A Deadline arms the event loop's timer only when none is armed early enough;
a timer that fires before the deadline (which moved later meanwhile) re-arms itself for it, and one that finds no
deadline set ends quietly. On a keep-alive connection that is one timer per timeout period, not one a wait.
The listening side (gateway/server/listener.py) uses it for its head timeout too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

# A timer may fire up to a clock tick before its time (uvloop keeps the time in milliseconds): that close to
# the deadline is past it, rather than a re-arm that would fire again within the same tick.
TICK_S = 0.001


class Deadline:
    """One deadline at a time, on the event loop's clock; `expired` is called once it passes while set."""

    __slots__ = ("_at", "_expired", "_loop", "_timer", "_timer_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, expired: Callable[[], None]) -> None:
        self._loop = loop
        self._expired = expired
        self._at = math.inf  # math.inf: no deadline set
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # when the armed timer fires

    @property
    def pending(self) -> bool:
        return self._at != math.inf

    def set_at(self, at: float) -> None:
        """The deadline is now `at` (loop time); math.inf clears it."""
        self._at = at
        if at < self._timer_at:  # no timer, or one armed for a later deadline than this
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(at, self._fire), at

    def clear(self) -> None:
        """No deadline; an armed timer stays and finds nothing due."""
        self._at = math.inf

    def cancel(self) -> None:
        """The owner is done for good (its connection closed): no timer is left holding it, and neither is
        this deadline (`expired` is usually the owner's bound method, which holds it: a reference cycle that
        only the cyclic collector's full passes would free, a thousand connections' worth after a wave)."""
        self._at = math.inf
        self._expired = _owner_gone
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        at = self._at
        if at == math.inf:
            return
        if at - self._loop.time() > TICK_S:  # moved later since this timer was armed
            self.set_at(at)
            return
        self._at = math.inf
        self._expired()


def _owner_gone() -> None:
    """What a cancelled deadline calls should it be set again: nothing, its owner is gone."""
