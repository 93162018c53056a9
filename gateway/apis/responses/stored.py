"""The Responses API's stored state, owned by the gateway: what a stored response keeps, how a chained
request is expanded, and the JSON of retrieve, input_items and delete (as OpenAI's API answers them).

    stored = await responses_store.get(tenant, body["previous_response_id"])   # None: previous_not_found()
    body = expand(body, stored)                  # the full input: earlier input, earlier output, new input
    … forward; the answer (or the stream's final response object) …
    kept = record(body, answer, tenant, session, now)   # None with `store: false`
    await responses_store.put(kept, limits)

A record keeps the whole input its deployment got, so one read expands any chain, on any deployment or
replica, whichever of them answered the earlier steps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.apis import json_body
from gateway.apis.responses.wire import input_items
from gateway.errors import BadRequest, NotFound

MAX_PAGE = 100
DEFAULT_PAGE = 20
_GATEWAY_ID = re.compile(r"resp_[0-9a-f]{48}")  # what responses.new_response_id makes


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response the gateway keeps for its tenant."""

    tenant: str
    response_id: str
    created_at: float  # epoch seconds
    session_id: str | None  # the session its request was served in: a chained request's session
    previous_response_id: str | None
    input: list[Any]  # every input item its deployment got, earlier turns included
    response: dict[str, Any]  # the response object its client got

    def to_json(self) -> bytes:
        return json_body.encode({"tenant": self.tenant, "id": self.response_id, "at": self.created_at,
                              "session": self.session_id, "previous": self.previous_response_id,
                              "input": self.input, "response": self.response})

    @classmethod
    def from_json(cls, raw: bytes | str) -> StoredResponse:
        found = json.loads(raw)
        return cls(found["tenant"], found["id"], float(found["at"]), found.get("session"), found.get("previous"),
                   list(found.get("input") or ()), dict(found.get("response") or {}))


def is_response_id(text: str) -> bool:
    """Whether `text` can name a response the gateway keeps: anything else is not found without a store read."""
    return _GATEWAY_ID.fullmatch(text) is not None


def previous_not_found(response_id: str) -> NotFound:
    """As OpenAI's API answers a chain onto a response it does not have (or another tenant's)."""
    return NotFound(f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


def not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id")


def expand(body: Mapping[str, Any], stored: StoredResponse) -> dict[str, Any]:
    """The body with its input after everything the chain held: the earlier input, the earlier output,
    then this request's. The earlier `instructions` are not carried over (as in OpenAI's API)."""
    output = stored.response.get("output")
    earlier = stored.input + (output if isinstance(output, list) else [])
    return {**body, "input": earlier + input_items(body)}


def chain_session(stored: StoredResponse) -> str:
    """The session a chained request belongs to: its chain's, else one named by the response it continues."""
    return stored.session_id or "r:" + stored.response_id


def record(body: Mapping[str, Any], answer: Any, tenant: str, session_id: str | None,
           now: float) -> StoredResponse | None:
    """What to keep of a finished response (an answer or a stream's final response object); None when the
    client asked not to store it (`store: false`) or the answer is no response object."""
    if body.get("store") is False or not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
        return None
    previous = body.get("previous_response_id")
    previous = previous if isinstance(previous, str) else None
    response = {**answer, "previous_response_id": previous, "store": True}
    return StoredResponse(tenant, answer["id"], now, session_id, previous, input_items(body), response)


def retrieve(stored: StoredResponse) -> dict[str, Any]:
    """`GET /v1/responses/{id}`."""
    return stored.response


def deleted(response_id: str) -> dict[str, Any]:
    """`DELETE /v1/responses/{id}`."""
    return {"id": response_id, "object": "response", "deleted": True}


def input_items_page(stored: StoredResponse, query: Mapping[str, str]) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items` with OpenAI's `limit` (1-100, 20), `order` (desc) and `after`."""
    limit, order, after = _page_query(query)
    items = [_listed(item, stored.response_id, i) for i, item in enumerate(stored.input)]
    if order == "desc":
        items.reverse()
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise BadRequest(f"No input item with id '{after}' in response '{stored.response_id}'", param="after")
        items = items[position + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _page_query(query: Mapping[str, str]) -> tuple[int, str, str | None]:
    raw_limit = query.get("limit", str(DEFAULT_PAGE))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
        raise BadRequest(f"'limit' must be an integer from 1 to {MAX_PAGE}, got {raw_limit!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    return int(raw_limit), order, query.get("after")


def _listed(item: Any, response_id: str, index: int) -> dict[str, Any]:
    """An input item as the list shows it: with an id (a stable one made up when the client sent none) and
    a message's string content as an input_text part."""
    if not isinstance(item, dict):
        item = {"type": "message", "role": "user", "content": item}
    out = dict(item)
    out.setdefault("type", "message")
    out.setdefault("id", f"item_{response_id.removeprefix('resp_')[:24]}_{index}")
    if out["type"] == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    return out
