"""Workers of one server share health and load through the board: one probes, failures and in-flight add up."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.policy.model import Policy, parse
from gateway.upstream.board import STALE_S, Board, Posting, Probe
from gateway.upstream.client import Pool
from gateway.upstream.deployments import Deployments
from gateway.upstream.forward import make_client
from tests.fixtures.conditions import until
from tests.fixtures.stack import policy_yaml


@pytest.fixture
async def policy(fake_pair: Any) -> Policy:
    _, hq_server, _, fast_server = fake_pair
    return parse(policy_yaml(str(hq_server.make_url("")).rstrip("/"), str(fast_server.make_url("")).rstrip("/")))


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    client = make_client()
    yield client
    await client.close()


async def test_one_worker_probes_and_the_others_take_its_figures(
    policy: Policy, pool: Pool, fake_pair: Any, tmp_path: Path
) -> None:
    first = Deployments(pool, board=Board(tmp_path, 0))
    second = Deployments(pool, board=Board(tmp_path, 1))
    first.reconcile(policy)
    second.reconcile(policy)
    try:
        await until(lambda: first.probing and not second.probing)
        hq = fake_pair[0]
        hq.healthy = False
        await until(lambda: not second.load["hq"].healthy)
        first_hq, second_hq = first.tracked("hq"), second.tracked("hq")
        assert first_hq is not None and second_hq is not None
        assert second_hq.probed_at == first_hq.probed_at > 0  # the prober's check, not one of its own
        await first.close()  # the prober stops: the next worker takes over at once (its posting is withdrawn)
        await until(lambda: second.probing)
        hq.healthy = True
        await until(lambda: second.load["hq"].healthy)
    finally:
        await first.close()
        await second.close()


async def test_failures_and_requests_in_flight_count_across_workers(
    policy: Policy, pool: Pool, tmp_path: Path
) -> None:
    first = Deployments(pool, board=Board(tmp_path, 0))
    second = Deployments(pool, board=Board(tmp_path, 1))
    first.reconcile(policy)
    second.reconcile(policy)
    try:
        first.record_failure("hq")  # eject_after_failures is 2: one failure in each worker ejects
        await until(lambda: second.failures("hq") == 1)
        assert second.load["hq"].healthy
        second.record_failure("hq")
        assert not second.load["hq"].healthy
        first_hq = first.tracked("hq")
        assert first_hq is not None
        await until(lambda: first_hq.ejected_until > 0)  # the ejection reaches the worker that did not eject
        first.in_flight["fast"] += 3
        await until(lambda: second.in_flight_now()["fast"] == 3)
        assert second.in_flight["fast"] == 0  # its own count stays its own
    finally:
        await first.close()
        await second.close()


def test_a_stale_or_unreadable_posting_is_ignored(tmp_path: Path) -> None:
    board = Board(tmp_path, 1)
    probe = Probe(True, 1.0, 2.0, 0.5, None, time.time())
    Board(tmp_path, 0).post(Posting(0, 1, time.time() - STALE_S - 1, {"hq": probe}, {"hq": 5}))
    (tmp_path / "worker-2.json").write_text("{not json")
    Board(tmp_path, 3).post(Posting(3, 3, time.time(), {"hq": probe}, {"hq": 2}, {"hq": 1}))
    others = board.read()
    assert others.prober == 1  # worker 0 has gone stale; 1 (this one) is the lowest still posting
    assert others.in_flight == {"hq": 2} and others.failures == {"hq": 1} and others.probes == {}


def test_a_posting_reads_back_as_written(tmp_path: Path) -> None:
    probe = Probe(True, 1.0, 2.0, 0.5, (10.0, 40.0, 25.0), time.time())  # with the prober's spec-decode counts
    posting = Posting(0, 1, time.time(), {"fast": probe}, {"fast": 2}, {"hq": 1}, {"hq": time.time() + 5})
    assert Posting.from_json(posting.to_json()) == posting
