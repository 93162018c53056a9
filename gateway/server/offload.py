"""The policy's context rules on the request path: old tool outputs masked (context/masking.py) and their
originals written to the object store before the stubs that name them leave the gateway.

A store that cannot take an original leaves the prompt unmasked (dearer, never a dangling reference). An original
stored recently is not written again at each step: an agent re-sends every masked output every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.context.masking import Masked, Masking, MaskRule
from gateway.context.tool_outputs import ToolOutputs, masked_body
from gateway.policy.model import Policy
from gateway.store.contract import StoreError
from gateway.store.objects import ObjectStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

REMEMBERED = 100_000  # (tenant, reference) pairs known stored; an older one is written again, which is harmless
REFRESH_FRACTION = 0.1  # an original still masked is stored again after this share of the store's TTL


class Offload:
    """Masks a call's old tool outputs by its policy's rule and keeps the originals in the object store."""

    def __init__(self, store: ObjectStore, metrics: Metrics, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self._metrics, self._clock = store, metrics, clock
        self._refresh_s = ttl_s * REFRESH_FRACTION
        self._stored: OrderedDict[tuple[str, str], float] = OrderedDict()

    async def mask(self, shape: ToolOutputs | None, policy: Policy, body: dict[str, Any], tenant: str | None,
                   owner: str) -> tuple[dict[str, Any], Masking | None]:
        """The body the deployment gets and what was masked in it (None: no rule, or the store failed);
        `owner` is the tenant the originals are kept under."""
        if shape is None or not policy.masks_context:
            return body, None
        rule = policy.mask_rule(str(body.get("model")), tenant)
        return (body, None) if rule is None else await self.mask_by(shape, rule, body, owner)

    async def mask_by(self, shape: ToolOutputs, rule: MaskRule, body: dict[str, Any],
                      owner: str) -> tuple[dict[str, Any], Masking | None]:
        """The body masked by this rule, whatever the policy's (an agent's summary request that fits no window)."""
        masked, masking = masked_body(shape, body, rule)
        if not masking.masked:
            return body, masking
        try:
            await self._keep(owner, masking.fresh)
        except StoreError as exc:
            log.warning("context: the object store failed (%s); this prompt goes unmasked", exc)
            self._metrics.count_offload("failed", len(masking.fresh))
            return body, None
        return masked, masking

    async def find(self, tenant: str, ref: str) -> bytes | None:
        return await self.store.get(tenant, ref)

    async def _keep(self, owner: str, fresh: Sequence[Masked]) -> None:
        now = self._clock()
        due = {m.ref: m for m in fresh if self._stored.get((owner, m.ref), -1e18) + self._refresh_s <= now}
        if not due:
            return
        data = {ref: m.original.encode("utf-8", "surrogatepass") for ref, m in due.items() if m.original is not None}
        await asyncio.gather(*(self.store.put(owner, ref, blob) for ref, blob in data.items()))
        self._metrics.count_offload("stored", len(data), sum(len(blob) for blob in data.values()))
        self._remember(owner, data, now)

    def _remember(self, owner: str, stored: Mapping[str, bytes], now: float) -> None:
        for ref in stored:
            self._stored[(owner, ref)] = now
            self._stored.move_to_end((owner, ref))
        while len(self._stored) > REMEMBERED:
            self._stored.popitem(last=False)
