"""The object store of masked tool outputs: the contract, and its embedded twin on the local disk.

Objects are content-addressed (`ctx_<sha256>`) and kept per tenant: a reference resolves only in the tenant
that stored it. The disk store is bounded in bytes (in all, and per tenant; the least recently stored go first)
and forgets an object `ttl_s` after it was last stored. Its file work runs on a small thread pool behind a bounded
number of waiting operations, so the event loop never blocks on a disk and never queues without end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from gateway.context.masking import reference
from gateway.store.contract import StoreError

log = logging.getLogger(__name__)

_SAFE_TENANT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")
_REF = re.compile(r"^ctx_[0-9a-f]{64}$")
T = TypeVar("T")


class ObjectStore(Protocol):
    """Originals by (tenant, reference); a put is done (durably, as this store goes) when it returns."""

    async def put(self, tenant: str, ref: str, data: bytes) -> None: ...

    async def get(self, tenant: str, ref: str) -> bytes | None:
        """The object, or None: never stored in this tenant, evicted or expired."""
        ...

    async def close(self) -> None: ...


def tenant_folder(tenant: str) -> str:
    """A tenant's folder (or key prefix): its name when it is a safe one, else a digest of it."""
    if _SAFE_TENANT.match(tenant):
        return "t_" + tenant
    return "h_" + hashlib.sha256(tenant.encode()).hexdigest()[:32]


def object_key(tenant: str, ref: str) -> str:
    """Where an object lives under the store's root: tenant, fan-out by the digest's first byte, reference."""
    if not _REF.match(ref):
        raise ValueError(f"not an object reference: {ref!r}")
    return f"{tenant_folder(tenant)}/{ref[4:6]}/{ref}"


def addressed(ref: str, data: bytes) -> None:
    """An object goes only under its own content's reference (what makes a reference mean one content)."""
    if reference(data) != ref:
        raise ValueError(f"{ref} is not the reference of these {len(data)} bytes")


class DiskObjects:
    """Objects as files under `root`, indexed in memory (rebuilt from the folder at open)."""

    def __init__(self, root: str | Path, max_bytes: int, ttl_s: float, tenant_max_bytes: int | None = None,
                 clock: Callable[[], float] = time.time, workers: int = 2, max_waiting: int = 256) -> None:
        self.root = Path(root)
        self.max_bytes, self.ttl_s, self.tenant_max_bytes = max_bytes, ttl_s, tenant_max_bytes
        self._clock = clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="objects")
        self._slots = asyncio.Semaphore(max_waiting)
        # key -> (tenant folder, size, stored at), least recently stored first
        self._index: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}
        self._writing: dict[str, asyncio.Future[None]] = {}

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    async def open(self) -> None:
        """Index what an earlier run left in the folder, oldest first."""
        found = await self._run(self._scan)
        for key, size, at in sorted(found, key=lambda f: f[2]):
            self._add(key, size, at)
        await self._evict()

    async def put(self, tenant: str, ref: str, data: bytes) -> None:
        key = object_key(tenant, ref)
        now = self._clock()
        pending = self._writing.get(key)
        if pending is not None:  # the same object on its way from another request: done when it is
            await asyncio.shield(pending)
            return
        if key in self._index and self._index[key][2] + self.ttl_s > now:
            folder, size, _ = self._index[key]
            self._index[key] = (folder, size, now)
            self._index.move_to_end(key)
            await self._run(_touch, self.root / key, now)
            return
        addressed(ref, data)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writing[key] = done
        try:
            await self._run(_write, self.root / key, data, now)
        except BaseException as exc:
            failed = StoreError(f"object store: cannot write {key}: {getattr(exc, 'strerror', None) or exc!r}")
            done.set_exception(failed)
            done.exception()  # marked retrieved: no request may be waiting on it
            if isinstance(exc, OSError):
                raise failed from exc
            raise
        else:
            self._drop(key)
            self._add(key, len(data), now)
            done.set_result(None)
        finally:
            del self._writing[key]
        await self._evict()

    async def get(self, tenant: str, ref: str) -> bytes | None:
        try:
            key = object_key(tenant, ref)
        except ValueError:
            return None
        # Read from the folder, not the index: another worker process of this replica may have stored it.
        found = await self._run(_read, self.root / key)
        if found is None:
            return None
        data, stored_at = found
        return data if stored_at + self.ttl_s > self._clock() else None

    async def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def _evict(self) -> None:
        """Expired objects, then the least recently stored while over a bound, removed from the folder."""
        now, doomed = self._clock(), []
        while self._index:
            key, (_, _, at) = next(iter(self._index.items()))
            if at + self.ttl_s > now and self._bytes <= self.max_bytes:
                break
            doomed.append(key)
            self._drop(key)
        if self.tenant_max_bytes is not None:
            over = {f for f, n in self._tenant_bytes.items() if n > self.tenant_max_bytes}
            for key in [k for k, (f, _, _) in self._index.items() if f in over]:
                folder = self._index[key][0]
                if self._tenant_bytes.get(folder, 0) > self.tenant_max_bytes:
                    doomed.append(key)
                    self._drop(key)
        if doomed:
            await self._run(_remove, [self.root / key for key in doomed])

    def _add(self, key: str, size: int, at: float) -> None:
        folder = key.split("/", 1)[0]
        self._index[key] = (folder, size, at)
        self._bytes += size
        self._tenant_bytes[folder] = self._tenant_bytes.get(folder, 0) + size

    def _drop(self, key: str) -> None:
        found = self._index.pop(key, None)
        if found is not None:
            folder, size, _ = found
            self._bytes -= size
            self._tenant_bytes[folder] -= size

    def _scan(self) -> list[tuple[str, int, float]]:
        found = []
        for path in self.root.glob("*/*/ctx_*"):
            if _REF.match(path.name):
                with contextlib.suppress(FileNotFoundError):
                    stat = path.stat()
                    found.append((path.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime))
        return found

    async def _run(self, func: Callable[..., T], *args: object) -> T:
        async with self._slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, func, *args)


def _write(path: Path, data: bytes, at: float) -> None:
    """Written whole or not at all: a reader never sees half an object."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{id(data):x}")
    with open(temporary, "wb") as out:
        out.write(data)
    os.utime(temporary, (at, at))
    os.replace(temporary, path)


def _touch(path: Path, at: float) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, (at, at))


def _read(path: Path) -> tuple[bytes, float] | None:
    try:
        with open(path, "rb") as found:
            return found.read(), os.fstat(found.fileno()).st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None


def _remove(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
