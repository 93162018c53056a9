"""The C encoder of spans (gateway/telemetry/_otlp_text.c) against otlp.py's Python encoder."""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from json.encoder import encode_basestring_ascii
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.trace import SpanKind

from gateway.telemetry import metrics as t
from gateway.telemetry import otlp

# Where the extension did not compile outside CI these tests skip and the Python encoder serves; in CI they all
# run, and the build check fails.
pytestmark = pytest.mark.skipif(otlp.native is None and os.environ.get("CI") != "true",
                                reason="the optional C extension did not build")


def native(attributes: Any) -> str | None:
    assert otlp.native is not None, "gateway/telemetry/_otlp_text.c did not build: setup.py build_ext"
    return otlp.native.attributes_json(attributes, encode_basestring_ascii)


scalars = (st.text() | st.integers() | st.integers(min_value=-(2**200), max_value=2**200) | st.booleans()
           | st.floats(allow_nan=True, allow_infinity=True))
# OpenTelemetry's attribute values: a scalar or a sequence of them
values = scalars | st.lists(scalars, max_size=4) | st.lists(scalars, max_size=4).map(tuple)


@settings(max_examples=2_000, deadline=None)
@given(st.dictionaries(st.text(), values, max_size=12))
def test_any_attributes_of_the_types_it_takes_encode_as_the_python_encoder_does(attributes: dict[str, Any]) -> None:
    encoded = native(attributes)
    assert encoded == otlp._python_attributes_json(attributes)
    assert isinstance(json.loads(encoded), list)


def test_a_request_spans_attributes_encode_as_the_python_encoder_does() -> None:
    attributes = {t.REQUEST_ID: "gw-00000000002a", t.GEN_AI_OPERATION: "chat", t.GEN_AI_REQUEST_MODEL: "auto",
                  t.RULE: "complexity-to-fast", t.REASONS: ("complexity 0.31 < 0.5", "budget: no failover"),
                  t.GEN_AI_REQUEST_MAX_TOKENS: 16, t.COMPLEXITY: 0.3125, "http.response.status_code": 200,
                  t.DEPLOYMENT: "fast", t.ATTEMPTS: ("fast", "hq"), t.GEN_AI_INPUT_TOKENS: 21, t.TTFT_MS: 1.75}
    assert native(attributes) == otlp._python_attributes_json(attributes)
    assert otlp._attributes_json(attributes) == native(attributes)  # what serves is the C encoder


def test_strings_that_need_escapes_are_escaped_as_json_does() -> None:
    attributes = {"q\"k\\": 'x "quoted"\n\t\x00\x1f\x7f', "u": "café \U0001f389 \ud800", "ü": "", "": "plain"}
    encoded = native(attributes)
    assert encoded == otlp._python_attributes_json(attributes)
    assert encoded is not None and encoded.isascii()


def test_numbers_keep_their_type_and_non_finite_floats_their_otlp_names() -> None:
    encoded = native({"i": 1, "b": True, "f": 1.0, "n": math.nan, "p": math.inf, "m": -math.inf, "z": -0.0})
    assert encoded is not None
    assert [item["value"] for item in json.loads(encoded)] == [
        {"intValue": "1"}, {"boolValue": True}, {"doubleValue": 1.0}, {"doubleValue": "NaN"},
        {"doubleValue": "Infinity"}, {"doubleValue": "-Infinity"}, {"doubleValue": -0.0}]


class Text(str):
    pass


class Number(int):
    pass


@pytest.mark.parametrize("attributes", [
    pytest.param({"x": None}, id="None"),
    pytest.param({"x": b"bytes"}, id="bytes"),
    pytest.param({"x": Text("a str subclass")}, id="a str subclass value"),
    pytest.param({"x": Number(3)}, id="an int subclass value"),
    pytest.param({"x": ("ok", None)}, id="None in a tuple"),
    pytest.param({Text("k"): "v"}, id="a str subclass key"),
    pytest.param(OrderedDict(x="v"), id="a dict subclass"),
    pytest.param({"x": ((((((((((((((((((("deep",),),),),),),),),),),),),),),),),),),)}, id="nested past 16"),
])
def test_what_it_does_not_take_is_left_to_the_python_encoder(attributes: Any) -> None:
    assert native(attributes) is None
    assert otlp._attributes_json(attributes) == otlp._python_attributes_json(attributes)


def test_a_key_that_is_not_a_string_fails_as_in_python() -> None:
    assert native({1: "x"}) is None
    with pytest.raises(TypeError):
        otlp._attributes_json({1: "x"})


def test_an_encoder_that_returns_no_ascii_text_is_an_error_not_bad_json() -> None:
    assert otlp.native is not None
    with pytest.raises(TypeError, match="ASCII"):
        otlp.native.attributes_json({"x": "needs \"escape\""}, lambda text: "ü")


# the digits' edges too: a nibble of each word, each word's top, the carries of decimal digits
ids = st.integers(min_value=0, max_value=2**128 - 1) | st.sampled_from(
    [0, 1, 0xF, 0x10, 2**63, 2**64 - 1, 2**64, 2**64 + 0xA, 0xABCDEF << 100, 2**128 - 1])
times = st.integers(min_value=0, max_value=2**63 - 1) | st.sampled_from([0, 9, 10, 99, 10**18, 2**63 - 1])


@settings(max_examples=2_000, deadline=None)
@given(ids, st.integers(min_value=0, max_value=2**64 - 1), st.text(), st.sampled_from(list(SpanKind)), times, times,
       st.dictionaries(st.text(), values, max_size=6), st.none() | st.integers(min_value=0, max_value=2**64 - 1),
       st.none() | st.text())
def test_any_span_without_events_encodes_as_the_python_encoder_does(
    trace_id: int, span_id: int, name: str, kind: SpanKind, start_ns: int, end_ns: int, attributes: dict[str, Any],
    parent_span_id: int | None, error: str | None,
) -> None:
    args = (trace_id, span_id, name, kind, start_ns, end_ns, attributes, parent_span_id, error)
    assert otlp.native is not None
    assert otlp.native.span_text(*args[:3], kind.value + 1, *args[4:], encode_basestring_ascii) is not None
    encoded = otlp.span_text(*args)
    assert encoded == otlp._python_span_text(*args)
    json.loads(encoded)


@pytest.mark.parametrize("args", [
    pytest.param((2**128, 1, None), id="a trace id past 128 bits"),
    pytest.param((-1, 1, None), id="a negative trace id"),
    pytest.param((1, 2**64, None), id="a span id past 64 bits"),
    pytest.param((1, 1, 2**64), id="a parent id past 64 bits"),
    pytest.param((Number(1), 1, None), id="an int subclass id"),
])
def test_ids_it_does_not_take_are_left_to_the_python_encoder(args: tuple[Any, Any, Any]) -> None:
    trace_id, span_id, parent = args
    assert otlp.native is not None
    assert otlp.native.span_text(trace_id, span_id, "n", 2, 5, 6, {}, parent, None, encode_basestring_ascii) is None
    assert otlp.span_text(trace_id, span_id, "n", SpanKind.SERVER, 5, 6, {}, parent) == otlp._python_span_text(
        trace_id, span_id, "n", SpanKind.SERVER, 5, 6, {}, parent)


def test_times_past_64_bits_and_attributes_it_does_not_take_are_left_to_the_python_encoder() -> None:
    assert otlp.native is not None
    for start_ns, attributes in ((2**64, {}), (5, {"x": None})):
        assert otlp.native.span_text(1, 1, "n", 2, start_ns, 6, attributes, None, None, encode_basestring_ascii) is None
        assert otlp.span_text(1, 1, "n", SpanKind.SERVER, start_ns, 6, attributes) == otlp._python_span_text(
            1, 1, "n", SpanKind.SERVER, start_ns, 6, attributes)


def test_a_span_with_events_is_encoded_in_python_with_them() -> None:
    events = [(7, "agent.loop", {"gateway.loop": "repeated"})]
    encoded = json.loads(otlp.span_text(1, 2, "gateway chat", SpanKind.SERVER, 5, 9, {"a": 1}, None, None, events))
    assert encoded["events"] == [{"timeUnixNano": "7", "name": "agent.loop",
                                  "attributes": [{"key": "gateway.loop", "value": {"stringValue": "repeated"}}]}]
