"""The shared wait helper: a tolerated error is polled again, and a wait that runs out names it."""

from __future__ import annotations

import itertools

import pytest

from tests.fixtures.conditions import until, wait_until


def _flaky(failures: int) -> object:
    """A condition that times out `failures` times, then holds."""
    calls = itertools.count()

    def condition() -> str | None:
        if next(calls) < failures:
            raise TimeoutError("timed out")
        return "held"

    return condition


async def test_a_tolerated_error_is_polled_again() -> None:
    assert await until(_flaky(3), 5.0, every_s=0.001, tolerate=(OSError,)) == "held"  # type: ignore[arg-type]


def test_the_blocking_wait_polls_again_too() -> None:
    assert wait_until(_flaky(3), 5.0, every_s=0.001, tolerate=(OSError,)) == "held"  # type: ignore[arg-type]


async def test_an_error_not_tolerated_ends_the_wait() -> None:
    with pytest.raises(TimeoutError):
        await until(_flaky(1), 5.0, every_s=0.001)  # type: ignore[arg-type]


def test_a_wait_that_runs_out_names_the_last_error() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"scrape.*TimeoutError\('timed out'\)"):
        wait_until(_flaky(10**9), 0.05, what="scrape", every_s=0.001, tolerate=(OSError,))  # type: ignore[arg-type]
