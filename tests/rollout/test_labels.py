"""The pure side of labelling: which side is the reference, agreement, the judge's prompt and strict parse."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.rollout import labels as lb
from gateway.rollout.comparison import Completion


def _record(primary: str | None, shadow: str | None, ok: tuple[bool, bool] = (True, True), **checks: Any) -> Any:
    sides = {}
    for side, name, fine in (("primary", primary, ok[0]), ("shadow", shadow, ok[1])):
        sides[side] = {"ok": fine, "deployment": name, "json_valid": None, "tool_calls_valid": None}
    for key, (p, s) in checks.items():
        sides["primary"][key], sides["shadow"][key] = p, s
    return sides


SPEC = lb.LabelsSpec(strong="hq")


@pytest.mark.parametrize(
    ("record", "spec", "expected"),
    [
        (_record("fast", "hq"), SPEC, ("shadow", "primary")),
        (_record("hq", "fast"), SPEC, ("primary", "shadow")),
        (_record("fast", "hq", ok=(True, False)), SPEC, lb.Skip.FAILED_SIDE),
        (_record("fast", "hq", ok=(False, True)), SPEC, lb.Skip.FAILED_SIDE),
        ({**_record("fast", "hq"), "shadow_truncated": True}, SPEC, lb.Skip.TRUNCATED),
        (_record("fast", "hq-v2"), SPEC, lb.Skip.NO_STRONG_SIDE),
        (_record("hq", "hq"), SPEC, lb.Skip.NO_STRONG_SIDE),  # a failover served the primary on hq
        (_record("hq-v2", "hq"), lb.LabelsSpec(strong="hq", weak="fast"), lb.Skip.OTHER_WEAK),
    ],
)
def test_sides_name_the_reference_and_refuse_pairs_that_are_no_label(record: Any, spec: Any, expected: Any) -> None:
    assert lb.sides(record, spec) == expected


@pytest.mark.parametrize(
    ("strong", "weak", "agrees"),
    [
        ("The answer is 42.", "The answer is 42.", True),
        ("The answer is 42.", "the answer is   42", True),  # normalized
        ("The answer is 42.", "The answer is 43.", False),  # a final number decides, however similar the words
        ("It costs 1,250 dollars", "1250", True),
        ("Paris is the capital of France.", "The capital of France is Paris.", True),  # similarity
        ("Paris is the capital of France.", "I cannot help with that request today.", False),
    ],
)
def test_agreement(strong: str, weak: str, agrees: bool) -> None:
    assert lb.agreement(strong, weak).agrees(0.5) is agrees


def test_answer_text_includes_tool_calls() -> None:
    done = Completion(text="", tool_calls=[{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    assert lb.answer_text(done) == '[tool call] get_weather({"city": "Paris"})'


@pytest.mark.parametrize(
    ("reply", "choice"),
    [("A", "A"), (" b\n", "B"), ("TIE.", "TIE"), ("tie", "TIE"),
     ("A or B", None), ("Answer A", None), ("", None), ("AB", None), ("A because it is right", None)],
)
def test_the_judge_reply_is_parsed_strictly(reply: str, choice: str | None) -> None:
    assert lb.parse_choice(reply) == choice


@pytest.mark.parametrize(
    ("choice", "strong_first", "verdict"),
    [
        ("A", True, lb.Verdict.WEAK_WORSE),
        ("B", True, lb.Verdict.WEAK_BETTER),
        ("A", False, lb.Verdict.WEAK_BETTER),
        ("B", False, lb.Verdict.WEAK_WORSE),
        ("TIE", False, lb.Verdict.TIE),
    ],
)
def test_the_random_order_is_undone(choice: str, strong_first: bool, verdict: lb.Verdict) -> None:
    assert lb.unswapped(choice, strong_first) is verdict


def test_judge_messages_are_the_fixed_prompt_with_bounded_parts() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "What is 17 + 25?"}]}]}
    messages = lb.judge_messages(lb.request_text(body), "first" * 1000, "second")
    assert messages[0] == {"role": "system", "content": lb.JUDGE_SYSTEM}
    user = messages[1]["content"]
    assert user.startswith("[Request]\nsystem: Be brief.\nuser: What is 17 + 25?\n\n[Answer A]\nfirst")
    assert user.endswith("[Answer B]\nsecond\n\nWhich answer is better? Reply A, B or TIE.")
    assert len(user) < lb.ANSWER_MAX_CHARS + 300
    assert lb.request_text({"prompt": "x" * 10_000}) == "x" * lb.REQUEST_MAX_CHARS


def test_objective_checks_decide_before_any_judge() -> None:
    record = _record("fast", "hq", json_valid=(False, True))
    assert lb.checked(record, "shadow", "primary") is lb.Verdict.WEAK_WORSE
    assert lb.checked(_record("fast", "hq"), "shadow", "primary") is None
    assert lb.qualities(lb.Verdict.WEAK_WORSE) == (1.0, 0.0) and lb.qualities(lb.Verdict.TIE) == (1.0, 1.0)
