"""Which arm a request of a rollout is on; a session's first arm is recorded in the store and kept for its whole
trajectory (a long agent run is never moved to the other arm mid-way)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from gateway.rollout.assignment import Assignment, assign_session
from gateway.rollout.state import Arm, RolloutState
from gateway.store.contract import StoreError
from gateway.store.rollouts import RolloutKeys, RolloutStore

ARM_TTL_S = 3600  # how long a session's recorded arm outlives its last step (each step renews it)
ARM_CACHE_SIZE = 50_000
SESSION_SOURCES = ("session=", "header:x-session-id=")


class SessionArms:
    """The recorded arms this replica has seen (a bounded cache) and the ones stepped on since the last renewal."""

    def __init__(self, store: RolloutStore, keys: RolloutKeys) -> None:
        self._store, self.keys = store, keys
        self._arms: OrderedDict[str, Assignment] = OrderedDict()
        self._touched: set[str] = set()  # arms stepped on since the last renewal: their TTL is renewed then

    async def arm(self, state: RolloutState, key: str | None) -> Assignment:
        """The request's arm; a session's first arm is recorded (SET NX) and kept for its trajectory: each
        step renews it (batched into the next `renew`), so it lapses only ARM_TTL_S after the last step."""
        if key is None or not key.startswith(SESSION_SOURCES) or state.weight_pct >= 100:
            return assign_session(state, key, None) or Assignment(state.rollout_id, state.run, Arm.STABLE)
        cache_key = self.keys.arm(state.rollout_id, state.run, key)
        recorded = self._arms.get(cache_key)
        if recorded is None:
            fresh = assign_session(state, key, None)
            assert fresh is not None
            try:
                recorded = Assignment.decode(
                    await self._store.record_arm(cache_key, fresh.encode(), ARM_TTL_S)
                )
            except StoreError:
                return Assignment(state.rollout_id, state.run, Arm.STABLE)  # fail safe, not remembered
            recorded = recorded or fresh
            self._arms[cache_key] = recorded
            if len(self._arms) > ARM_CACHE_SIZE:
                self._arms.popitem(last=False)
        self._touched.add(cache_key)
        return assign_session(state, key, recorded) or recorded

    async def renew(self) -> None:
        """Renew the TTL of every arm stepped on since the last call."""
        touched, self._touched = self._touched, set()
        if touched:
            with contextlib.suppress(StoreError):  # best effort: the session's next step renews it again
                await self._store.touch_arms(sorted(touched), ARM_TTL_S)
