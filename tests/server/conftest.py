"""Every server test's request bodies go through the parse memory (gateway/apis/recurring.py), not only those over its
production threshold; and after each test, whatever the memory kept still equals the parse of its bytes: no stage
of the pipeline edited a value that later requests share."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from gateway.apis import json_body, recurring
from gateway.server import resources


@pytest.fixture(autouse=True)
def bodies_read_through_the_parse_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    made: list[recurring.Recurring] = []

    class Watched(recurring.Recurring):
        def __init__(self, max_bytes: int) -> None:
            super().__init__(max_bytes)
            made.append(self)

    monkeypatch.setattr(resources, "Recurring", Watched)
    monkeypatch.setattr(json_body, "RECURRING_MIN_BODY", 0)
    monkeypatch.setattr(recurring, "MIN_KEPT", 0)
    monkeypatch.setattr(recurring, "HEAD_LENGTHS", (4096, 256, 16))
    yield
    for memory in made:
        for raw, value in memory.kept():
            assert value == msgspec.json.decode(raw), f"a shared parse was edited in place: {raw[:200]!r}"
