"""The structured inputs: each one's expression, and a model's terms compiled into one sum that is the same float
as adding the terms one by one."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.classifier.cues import NO_CUES, read_cues
from gateway.classifier.inputs import FEATURES_ONLY, INPUTS, SOURCES, compile_terms
from gateway.classifier.scoring import Classifier
from gateway.features import extract

ASKS = [
    "What is the capital of France?",
    "Find the degree of Q(sqrt(2), sqrt(3)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:",
    "Write a python function to remove first and last occurrence of a given character from the string.",
    "Simplify $\\frac{91}{26}.$ Explain your reasoning step by step.",
    "运行中变压器温度最高的部分是\nA. 绕组\nB. 变压器油\nC. 引线\nD. 铁芯\n答案\uff1a",
    "",
]


def one_by_one(terms: list[tuple[str, float, float, float, float]], f: Any, c: Any, z: float) -> float:
    """The definition: each input's value clamped to its range, centred and scaled, added in order."""
    for name, mean, slope, low, high in terms:
        value = INPUTS[name](f, c)
        z += slope * ((low if value < low else high if value > high else value) - mean)
    return z


def features_of(ask: str, **extra: Any) -> Any:
    return extract({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ask}],
                    **extra}, "chat")


def test_every_input_reads_a_request_as_a_float() -> None:
    for ask in ASKS:
        f = features_of(ask, max_tokens=50, response_format={"type": "json_object"})
        for name, value_of in INPUTS.items():
            assert isinstance(value_of(f, read_cues(f)), float), name


def test_inputs_of_the_features_alone_never_read_the_cues() -> None:
    # a model weighing only these is scored without reading the cues (Classifier.reads_cues)
    f = features_of(ASKS[0])
    assert set(SOURCES) >= FEATURES_ONLY
    for name in FEATURES_ONLY:
        assert "c." not in SOURCES[name], name
        INPUTS[name](f, None)  # type: ignore[arg-type]  # would raise AttributeError on a read of the cues


def test_counts_below_zero_read_as_zero() -> None:
    f = dataclasses.replace(features_of(ASKS[0]), max_tokens=-5)
    assert INPUTS["max_tokens"](f, NO_CUES) == 0.0


def test_the_default_model_sums_its_terms_as_one_by_one() -> None:
    model = Classifier.default()
    terms = [(n.name, n.mean, n.coef / n.scale, n.low, n.high) for n in model.numeric if n.coef]
    compiled = compile_terms(terms)
    for ask in ASKS:
        for extra in ({}, {"max_tokens": 7}, {"tools": [{"type": "function", "function": {"name": "x"}}]}):
            f = features_of(ask, **extra)
            c = read_cues(f)
            assert compiled(f, c, 0.25) == one_by_one(terms, f, c, 0.25)  # the same float, not a close one


_FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(
    st.lists(st.tuples(st.sampled_from(sorted(SOURCES)), _FINITE, _FINITE,
                       st.one_of(st.just(-math.inf), _FINITE), st.one_of(st.just(math.inf), _FINITE)),
             max_size=30),
    st.sampled_from(ASKS),
    st.integers(min_value=0, max_value=100_000),
)
def test_any_terms_compile_to_their_one_by_one_sum(
    terms: list[tuple[str, float, float, float, float]], ask: str, max_tokens: int
) -> None:
    f = features_of(ask, max_tokens=max_tokens or None)
    c = read_cues(f)
    expected = one_by_one(terms, f, c, -1.5)
    assert compile_terms(terms)(f, c, -1.5) == expected


def test_the_sum_raises_where_the_one_by_one_sum_does() -> None:
    terms = [("prompt_tokens", 0.0, 1.0, -math.inf, math.inf)]
    f = dataclasses.replace(features_of(ASKS[0]), prompt_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compile_terms(terms)(f, NO_CUES, 0.0)
    with pytest.raises(TypeError):
        one_by_one(terms, f, NO_CUES, 0.0)


def test_no_terms_leave_z_as_it_is() -> None:
    assert compile_terms([])(features_of(""), NO_CUES, 3.0) == 3.0


@pytest.mark.parametrize("constant", [math.nan, math.inf, -math.inf])
def test_non_finite_constants_compile(constant: float) -> None:
    # an artifact could hold them; the compiled code must read them as the loop does, not fail to compile
    f = features_of(ASKS[0])
    terms = [("ask_chars", constant, 1.0, -math.inf, math.inf), ("digits", 0.0, constant, constant, math.inf)]
    expected, got = one_by_one(terms, f, NO_CUES, 0.0), compile_terms(terms)(f, NO_CUES, 0.0)
    assert got == expected or (math.isnan(got) and math.isnan(expected))
