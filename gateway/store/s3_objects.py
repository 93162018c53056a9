"""Masked tool outputs in an S3 bucket (or an S3-compatible server) that every replica shares, through obstore.

The one module that talks to obstore: its errors become StoreError here, chained. Keys are the disk store's
(`PREFIX/TENANT/ab/ctx_<sha256>`): a reference resolves only under its tenant. The bucket's lifecycle rule
deletes old objects; a read of one older than `ttl_s` is refused all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import S3Store

from gateway.store.contract import StoreError
from gateway.store.objects import addressed, object_key


class S3Objects:
    def __init__(self, bucket: str, prefix: str, region: str, endpoint: str | None, timeout_s: float, ttl_s: float,
                 clock: Callable[[], float] = time.time, **credentials: str) -> None:
        config: dict[str, Any] = {"region": region, **credentials}
        if endpoint is not None:
            config["endpoint"] = endpoint
        client = {"timeout": timedelta(seconds=timeout_s), "connect_timeout": timedelta(seconds=min(timeout_s, 5)),
                  "allow_http": endpoint is not None and endpoint.startswith("http://")}
        try:
            self._store = S3Store(bucket, prefix=prefix or None, config=config,  # type: ignore[arg-type]
                                  client_options=client)  # type: ignore[arg-type]
        except BaseError as exc:
            raise StoreError(f"object store: cannot use bucket {bucket!r}: {exc}") from exc
        self.bucket, self.ttl_s, self._clock = bucket, ttl_s, clock

    async def put(self, tenant: str, ref: str, data: bytes) -> None:
        key = object_key(tenant, ref)
        addressed(ref, data)
        try:
            await obstore.put_async(self._store, key, data)
        except (BaseError, OSError) as exc:
            raise StoreError(f"object store: cannot write {key} to bucket {self.bucket!r}: {exc}") from exc

    async def get(self, tenant: str, ref: str) -> bytes | None:
        try:
            key = object_key(tenant, ref)
        except ValueError:
            return None
        try:
            found = await obstore.get_async(self._store, key)
            if found.meta["last_modified"].timestamp() + self.ttl_s <= self._clock():
                return None
            return bytes(await found.bytes_async())
        except (NotFoundError, FileNotFoundError):
            return None
        except (BaseError, OSError) as exc:
            raise StoreError(f"object store: cannot read {key} from bucket {self.bucket!r}: {exc}") from exc

    async def close(self) -> None:
        return None
