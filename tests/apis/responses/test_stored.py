"""The Responses API's state as the gateway keeps it: what a record holds, a chain expanded into the full input,
and the JSON of retrieve, input_items (OpenAI's list shape and paging) and delete."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from gateway.apis.responses import stored
from gateway.apis.responses.stored import StoredResponse
from gateway.apis.responses.wire import ResponsesReader
from gateway.errors import BadRequest, NotFound

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "captured"
FIRST = {"model": "m", "instructions": "Be brief.", "input": "Weather in Paris?"}


def _answer(response_id: str) -> dict[str, Any]:
    """A captured vLLM answer, renamed as the gateway hands it on."""
    return {**json.loads((CAPTURED / "responses_tool.json").read_bytes()), "id": response_id}


def _first() -> StoredResponse:
    kept = stored.record(FIRST, _answer("resp_1"), "acme", None, 1000.0)
    assert kept is not None
    return kept


def test_a_record_keeps_the_input_and_the_response_as_the_client_got_it() -> None:
    kept = _first()
    assert kept.input == [{"role": "user", "content": "Weather in Paris?"}]
    assert (kept.tenant, kept.response_id, kept.created_at) == ("acme", "resp_1", 1000.0)
    assert kept.previous_response_id is None
    assert kept.response["output"] == _answer("resp_1")["output"]
    assert StoredResponse.from_json(kept.to_json()) == kept


def test_store_false_or_no_response_object_keeps_nothing() -> None:
    assert stored.record({**FIRST, "store": False}, _answer("resp_1"), "acme", None, 1.0) is None
    assert stored.record(FIRST, {"error": {"message": "x"}}, "acme", None, 1.0) is None
    assert stored.record(FIRST, None, "acme", None, 1.0) is None


def test_a_chained_request_gets_the_earlier_input_and_output_then_its_own() -> None:
    first = _first()
    call_output = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
    second = {"model": "m", "previous_response_id": "resp_1", "input": [call_output], "instructions": "New."}
    expanded = stored.expand(second, first)
    assert expanded["input"] == [*first.input, *first.response["output"], call_output]
    assert expanded["instructions"] == "New." and expanded["previous_response_id"] == "resp_1"
    kept = stored.record(expanded, _answer("resp_2"), "acme", stored.chain_session(first), 1001.0)
    assert kept is not None and kept.input == expanded["input"] and kept.previous_response_id == "resp_1"
    assert kept.response["previous_response_id"] == "resp_1" and kept.session_id == "r:resp_1"
    third = stored.expand({"model": "m", "previous_response_id": "resp_2", "input": "thanks"}, kept)
    assert third["input"][: len(expanded["input"])] == expanded["input"]
    assert stored.chain_session(kept) == "r:resp_1"  # the whole chain is one session


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_takes_an_expanded_body_with_its_own_output_items() -> None:
    with warnings.catch_warnings():  # torch, imported by vLLM, warns of its own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    streamed = ResponsesReader("resp_" + "b" * 48)
    streamed.feed((CAPTURED / "responses_tool_stream.sse").read_bytes())
    kept = stored.record(FIRST, streamed.final, "acme", None, 1.0)
    assert kept is not None
    call_id = kept.response["output"][0]["call_id"]
    body = stored.expand({"model": "tiny-fast", "previous_response_id": kept.response_id,
                          "input": [{"type": "function_call_output", "call_id": call_id, "output": "Sunny"}]}, kept)
    parsed = ResponsesRequest.model_validate(body)
    assert [getattr(item, "type", None) or item.get("type") for item in parsed.input][-2:] == [
        "function_call", "function_call_output"]


def test_retrieve_and_delete_answer_as_openais_api() -> None:
    kept = _first()
    assert stored.retrieve(kept)["id"] == "resp_1" and stored.retrieve(kept)["object"] == "response"
    assert stored.deleted("resp_1") == {"id": "resp_1", "object": "response", "deleted": True}
    missing = stored.previous_not_found("resp_x")
    assert isinstance(missing, NotFound) and missing.status == 404
    assert (missing.param, missing.code) == ("previous_response_id", "previous_response_not_found")
    assert stored.not_found("resp_x").status == 404


def _chain_of(count: int) -> StoredResponse:
    items = [{"role": "user", "content": f"m{i}"} if i % 2 else {"type": "message", "id": f"msg_{i}",
             "role": "assistant", "content": [{"type": "output_text", "text": f"a{i}"}]} for i in range(count)]
    kept = stored.record({"model": "m", "input": items}, _answer("resp_9"), "acme", None, 1.0)
    assert kept is not None
    return kept


def test_input_items_pages_newest_first_by_default_with_after_and_has_more() -> None:
    kept = _chain_of(45)
    page = stored.input_items_page(kept, {})
    assert page["object"] == "list" and len(page["data"]) == 20 and page["has_more"]
    assert page["data"][0]["id"] == page["first_id"] == "msg_44"  # the client's own id is kept
    assert page["data"][1] == {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "m43"}],
                               "id": "item_" + "resp_9"[5:] + "_43"}
    seen = [item["id"] for item in page["data"]]
    while page["has_more"]:
        page = stored.input_items_page(kept, {"after": page["last_id"]})
        seen += [item["id"] for item in page["data"]]
    assert len(seen) == len(set(seen)) == 45
    ascending = stored.input_items_page(kept, {"order": "asc", "limit": "100"})
    assert [item["id"] for item in ascending["data"]] == list(reversed(seen)) and not ascending["has_more"]
    assert ascending["data"][1]["content"] == [{"type": "input_text", "text": "m1"}]


@pytest.mark.parametrize("query", [{"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"order": "up"},
                                   {"after": "item_nope"}])
def test_bad_paging_is_a_400_naming_the_parameter(query: dict[str, str]) -> None:
    with pytest.raises(BadRequest) as raised:
        stored.input_items_page(_chain_of(3), query)
    assert raised.value.param == next(iter(query))


def test_only_the_gateways_own_ids_are_looked_up() -> None:
    from gateway.apis.responses.wire import new_response_id

    assert stored.is_response_id(new_response_id())
    for other in ("resp_1", "resp_" + "A" * 48, "resp_" + "a" * 48 + "\tx", "acme\tresp_" + "a" * 48, ""):
        assert not stored.is_response_id(other)
