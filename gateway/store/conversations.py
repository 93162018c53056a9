"""The Responses API's conversation state over its store: chained requests expanded, finished responses kept.

The state lives in the gateway's store (Redis when configured, this process's memory otherwise), scoped to the
tenant, never in one vLLM server's memory: so every step of an agent can go to either deployment and any replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.apis.responses import stored
from gateway.apis.responses.stored import StoredResponse
from gateway.decision.call import Call
from gateway.errors import StoreUnavailable
from gateway.store.contract import StoreError
from gateway.store.responses import ResponseLimits, ResponseStore

log = logging.getLogger(__name__)


class Conversations:
    """Stored responses by (tenant, id), for the request path and the retrieve / delete handlers."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def expand(self, body: dict[str, Any], tenant: str) -> tuple[dict[str, Any], str | None]:
        """The body with the whole conversation its `previous_response_id` names, and that chain's session."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return body, None
        found = await self.find(tenant, previous)
        if found is None:
            raise stored.previous_not_found(previous)
        return stored.expand(body, found), stored.chain_session(found)

    def keeper(self, call: Call, body: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], Awaitable[None]]:
        """What keeps this call's finished answer (unless it asked `store: false`), under the call's body or
        `body` (a compacted conversation: what a chain onto it reads before the answer's output)."""
        kept_body = call.body if body is None else body

        async def keep(answer: dict[str, Any]) -> None:
            record = stored.record(kept_body, answer, call.tenant_or_anonymous, call.session_id, time.time())
            if record is None:
                return
            limits = call.policy.store.responses  # the call's policy: a reload applies to the calls after it
            try:
                await self.store.put(record, ResponseLimits(limits.ttl_s, limits.max_per_tenant, limits.max_total))
            except StoreError as exc:  # the client has its answer; a later chain onto it will say not found
                log.warning("stored responses: could not keep %s: %s", record.response_id, exc)

        return keep

    async def find(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not stored.is_response_id(response_id):  # not one the gateway made: no store read
            return None
        try:
            return await self.store.get(tenant, response_id)
        except StoreError as exc:
            raise StoreUnavailable("The store of stored responses is unavailable; retry shortly") from exc
