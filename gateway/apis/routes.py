"""The one route table: which adapter serves each of the gateway's API paths."""

from __future__ import annotations

from gateway.apis.adapter import Adapter
from gateway.apis.agent_apis import COUNT_TOKENS, MESSAGES, RESPONSES
from gateway.apis.openai_api import CHAT, COMPLETIONS, EMBEDDINGS

ADAPTERS: tuple[Adapter, ...] = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS)
BY_PATH: dict[str, Adapter] = {adapter.path: adapter for adapter in ADAPTERS}  # the gateway's path is vLLM's
BY_ENDPOINT: dict[str, Adapter] = {adapter.endpoint: adapter for adapter in ADAPTERS}
