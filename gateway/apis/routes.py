"""The one route table: which adapter serves each of the gateway's API paths."""

from __future__ import annotations

from gateway.apis.adapter import Adapter
from gateway.apis.chat.adapter import CHAT, COMPLETIONS, EMBEDDINGS
from gateway.apis.messages.adapter import COUNT_TOKENS, MESSAGES
from gateway.apis.responses.adapter import RESPONSES, RESPONSES_COMPACT

ADAPTERS: tuple[Adapter, ...] = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS)
# The gateway's path is vLLM's; /v1/responses/compact is the gateway's alone (it answers it itself).
BY_PATH: dict[str, Adapter] = {adapter.path: adapter for adapter in (*ADAPTERS, RESPONSES_COMPACT)}
BY_ENDPOINT: dict[str, Adapter] = {adapter.endpoint: adapter for adapter in ADAPTERS}
RESUMABLE = frozenset(adapter.endpoint for adapter in ADAPTERS if adapter.resumable)


def api_of(path: str) -> Adapter | None:
    """The API a path of the gateway belongs to: its adapter's, else that of the API path it extends
    (`/v1/messages/batches` is Anthropic's, its errors in Anthropic's envelope); None for the gateway's own."""
    found = BY_PATH.get(path)
    while found is None and path.count("/") > 2:
        path = path.rsplit("/", 1)[0]
        found = BY_PATH.get(path)
    return found
