"""The object store of masked tool outputs: on the local disk (content-addressed, per tenant, bounded in bytes in
all and per tenant, a TTL, reopened from its folder) and in S3 against a real S3-compatible server (moto's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.context.masking import reference
from gateway.policy.context import ObjectStorePolicy
from gateway.store.contract import StoreError
from gateway.store.objects import DiskObjects, ObjectStore
from gateway.store.opening import open_objects
from gateway.store.s3_objects import S3Objects
from tests.fixtures.clock import ManualClock
from tests.fixtures.processes import free_port
from tests.fixtures.s3_server import S3Server

TTL_S = 3600.0


def blob(tag: str, size: int = 1000) -> tuple[str, bytes]:
    data = (tag * size)[:size].encode()
    return reference(data), data


@pytest.fixture
async def disk(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    opened: list[DiskObjects] = []

    async def make(max_bytes: int = 1 << 20, tenant_max_bytes: int | None = None,
                   clock: ManualClock | None = None) -> DiskObjects:
        store = DiskObjects(tmp_path / "objects", max_bytes, TTL_S, tenant_max_bytes,
                            clock=clock or ManualClock(1_000_000.0))
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture(params=["disk", "s3"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    """The same contract, both twins: the local disk and S3 (a real server process)."""
    if request.param == "disk":
        store: ObjectStore = DiskObjects(tmp_path / "objects", 1 << 20, TTL_S)
        await store.open()  # type: ignore[attr-defined]
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        store = open_objects(ObjectStorePolicy.model_validate(
            {"ttl_s": TTL_S, "s3": {"bucket": bucket, "endpoint": server.endpoint, "timeout_s": 5}}), "unused")
        assert isinstance(store, S3Objects)
    yield store
    await store.close()


async def test_an_object_comes_back_by_its_content_address_in_its_own_tenant_only(any_store: ObjectStore) -> None:
    ref, data = blob("pytest output\n", 5000)
    assert await any_store.get("acme", ref) is None
    await any_store.put("acme", ref, data)
    assert await any_store.get("acme", ref) == data
    assert await any_store.get("globex", ref) is None  # another tenant's reference is as absent as none
    await any_store.put("acme", ref, data)  # the same content again: the same object
    assert await any_store.get("acme", ref) == data


@pytest.mark.parametrize("ref", ["ctx_" + "0" * 63, "../../etc/passwd", "ctx_" + "G" * 64, ""])
async def test_a_malformed_reference_is_no_object(any_store: ObjectStore, ref: str) -> None:
    assert await any_store.get("acme", ref) is None


async def test_an_object_goes_only_under_its_own_contents_reference(any_store: ObjectStore) -> None:
    ref, _ = blob("a")
    with pytest.raises(ValueError, match="is not the reference"):
        await any_store.put("acme", ref, b"something else")
    assert await any_store.get("acme", ref) is None


async def test_the_disk_store_is_bounded_and_evicts_the_least_recently_stored(
    disk: Callable[..., Any], tmp_path: Path
) -> None:
    store: DiskObjects = await disk(max_bytes=3000)
    refs = [blob(tag) for tag in "abcd"]
    for ref, data in refs[:3]:
        await store.put("acme", ref, data)
    await store.put("acme", *refs[0])  # stored again: now the most recent
    await store.put("acme", *refs[3])
    assert store.stored_bytes == 3000
    kept = [await store.get("acme", ref) is not None for ref, _ in refs]
    assert kept == [True, False, True, True]  # b, the least recently stored, went
    files = sorted(p.name for p in (tmp_path / "objects").rglob("ctx_*"))
    assert files == sorted(ref for (ref, _), k in zip(refs, kept, strict=True) if k)


async def test_each_tenant_is_bounded_on_its_own(disk: Callable[..., Any]) -> None:
    store: DiskObjects = await disk(max_bytes=1 << 20, tenant_max_bytes=2000)
    theirs = blob("z")
    await store.put("globex", *theirs)
    mine = [blob(tag) for tag in "abc"]
    for ref, data in mine:
        await store.put("acme", ref, data)
    assert [await store.get("acme", ref) is not None for ref, _ in mine] == [False, True, True]
    assert await store.get("globex", theirs[0]) == theirs[1]  # a noisy tenant evicts only its own


async def test_an_object_expires_ttl_after_it_was_last_stored(disk: Callable[..., Any]) -> None:
    clock = ManualClock(1_000_000.0)
    store: DiskObjects = await disk(clock=clock)
    old, fresh = blob("o"), blob("f")
    await store.put("acme", *old)
    await store.put("acme", *fresh)
    clock.now += TTL_S - 10
    await store.put("acme", *fresh)  # still masked at a later step: kept on
    clock.now += 20
    assert await store.get("acme", old[0]) is None
    assert await store.get("acme", fresh[0]) == fresh[1]
    await store.put("acme", *blob("n"))  # a write sweeps what expired
    assert store.stored_bytes == 2000


async def test_the_disk_store_reopens_what_an_earlier_run_stored(disk: Callable[..., Any]) -> None:
    first: DiskObjects = await disk()
    ref, data = blob("kept")
    await first.put("acme", ref, data)
    again: DiskObjects = await disk()
    assert again.stored_bytes == len(data)
    assert await again.get("acme", ref) == data


async def test_concurrent_writes_of_one_object_store_it_once(disk: Callable[..., Any], tmp_path: Path) -> None:
    store: DiskObjects = await disk()
    ref, data = blob("same", 100_000)
    await asyncio.gather(*(store.put("acme", ref, data) for _ in range(20)))
    assert store.stored_bytes == len(data)
    assert [p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()] == [ref]


async def test_a_disk_that_refuses_a_write_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "objects").write_text("a file where the folder should be")
    store = DiskObjects(tmp_path / "objects", 1 << 20, TTL_S)
    try:
        with pytest.raises(StoreError, match="cannot write"):
            await store.put("acme", *blob("x"))
    finally:
        await store.close()


async def test_s3_refuses_an_object_older_than_the_ttl(s3_server: S3Server, s3_bucket: str) -> None:
    clock = ManualClock(0.0)
    store = S3Objects(s3_bucket, "ag", "us-east-1", s3_server.endpoint, 5, TTL_S, clock=clock)
    ref, data = blob("s3")
    await store.put("acme", ref, data)
    clock.now = time.time()
    assert await store.get("acme", ref) == data
    clock.now += TTL_S + 60
    assert await store.get("acme", ref) is None


async def test_an_unreachable_s3_is_a_store_error() -> None:
    store = S3Objects("ctx-nowhere", "ag", "us-east-1", f"http://127.0.0.1:{free_port()}", 2, TTL_S)
    with pytest.raises(StoreError, match="cannot write"):
        await store.put("acme", *blob("x"))
