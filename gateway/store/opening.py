"""open_stores(): the one place a process opens its stores, in memory or in Redis, from the policy and env."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policy.context import ObjectStorePolicy
from gateway.policy.tenancy import StorePolicy
from gateway.store.contract import Store
from gateway.store.fallback import FallbackStore
from gateway.store.labels import LabelStore, MemoryLabelStore, RedisLabelStore
from gateway.store.memory import MemoryStore
from gateway.store.objects import DiskObjects, ObjectStore
from gateway.store.pairs import MemoryShadowPairStore, RedisShadowPairStore, ShadowPairStore
from gateway.store.prefixes import MemoryPrefixStore, PrefixStore, RedisPrefixStore
from gateway.store.redis_store import RedisStore
from gateway.store.response_memory import MemoryResponseStore
from gateway.store.responses import RedisResponseStore, ResponseStore
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.store.rollouts import RedisRolloutStore, RolloutStore
from gateway.store.shares import MemoryShareWindowStore, RedisShareWindowStore, ShareWindowStore
from gateway.store.trajectories import RedisTrajectoryStore, TrajectoryStore
from gateway.store.trajectory_memory import MemoryTrajectoryStore


@dataclass(frozen=True, slots=True)
class Stores:
    """Accounting state (budgets, sessions, keys), rollout state (states, cohorts, arms), shadow pairs, their
    labels, the complexity-share windows, agent trajectories, the Responses API's stored responses, the agent
    sessions' prefix caches."""

    accounting: Store
    rollouts: RolloutStore
    pairs: ShadowPairStore
    labels: LabelStore
    shares: ShareWindowStore
    trajectories: TrajectoryStore
    responses: ResponseStore
    prefixes: PrefixStore
    shared: bool = False  # in Redis, seen by every replica (else this process's memory)

    async def close(self) -> None:
        for store in (self.accounting, self.rollouts, self.pairs, self.labels, self.shares, self.trajectories,
                      self.responses, self.prefixes):
            await store.close()


def open_stores(section: StorePolicy, env_redis_url: str | None = None, *, prefix: str = "ag") -> Stores:
    """Embedded memory without a Redis URL (the policy's `store.redis_url`, else AGENT_GATEWAY_REDIS_URL);
    with one, Redis for all, accounting behind the degraded-mode fallback."""
    url = section.redis_url or env_redis_url
    bound = section.memory_max_keys
    if not url:
        return Stores(MemoryStore(prefix=prefix, max_keys=bound), MemoryRolloutStore(max_keys=bound),
                      MemoryShadowPairStore(), MemoryLabelStore(), MemoryShareWindowStore(),
                      MemoryTrajectoryStore(), MemoryResponseStore(), MemoryPrefixStore())
    shared = RedisStore(
        url,
        timeout_s=section.timeout_s,
        prefix=prefix,
        max_connections=section.max_connections,
        pool_timeout_s=section.pool_timeout_s,
    )
    accounting = FallbackStore(
        shared, MemoryStore(prefix=prefix, max_keys=bound), on_unavailable=section.on_unavailable,
        retry_s=section.retry_s,
    )
    timeout_s = section.timeout_s
    return Stores(accounting, RedisRolloutStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisShadowPairStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisLabelStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisShareWindowStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisTrajectoryStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisResponseStore(url, timeout_s=timeout_s, prefix=prefix),
                  RedisPrefixStore(url, timeout_s=timeout_s, prefix=prefix), shared=True)


def open_objects(section: ObjectStorePolicy, default_dir: str) -> ObjectStore:
    """The object store of masked tool outputs: S3 when the policy names a bucket, else the local disk (the
    policy's `store.objects.path`, else `default_dir`); a DiskObjects must still be opened (`open()`)."""
    if section.s3 is not None:
        from gateway.store.s3_objects import S3Objects  # obstore's memory only where S3 is named

        s3 = section.s3
        return S3Objects(s3.bucket, s3.prefix, s3.region, s3.endpoint, s3.timeout_s, section.ttl_s)
    return DiskObjects(section.path or default_dir, section.max_bytes, section.ttl_s, section.tenant_max_bytes)
