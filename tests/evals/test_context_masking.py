"""`python -m evals.context_masking`: hand-made sessions whose received prompts are worked out by hand, masking's
stickiness, and the first committed sessions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from evals.context_masking import replay as masking_replay
from evals.context_masking.__main__ import main
from evals.context_masking.replay import STUB_FRAME_TOKENS, received, stub_tokens
from evals.session_cache.replay import chain_of_record, read_sessions, steps_of
from gateway.context.masking import MaskRule, stub_of
from gateway.features import load_encoding

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "evals" / "session_cache" / "data" / "mini-swe-agent-gemini-3-pro.jsonl.gz"
POLICY = str(ROOT / "policies" / "long-runs.yaml")

# head + tail 800 characters: 200 tokens shown, so a stub is STUB_FRAME_TOKENS + 200 tokens.
RULE = "keep_last=1,over_tokens=200,batch_tokens=1500,head_chars=400,tail_chars=400"
STUB = STUB_FRAME_TOKENS + 200


def _session(outputs: list[int]) -> dict[str, Any]:
    """system 100, task 50, then per output: a 10-token assistant turn and the output; a last assistant turn."""
    messages: list[list[Any]] = [["s", 100, "sys000000000", None], ["u", 50, "task00000000", None]]
    for n, tokens in enumerate(outputs):
        messages.append(["a", 10, f"a{n:011d}", f"c{n:011d}"])
        messages.append(["t", tokens, f"t{n:011d}", [0, 0]])
    messages.append(["a", 10, "last00000000", None])
    return {"id": "hand", "agent": "test", "source": "test", "messages": messages}


# The steps' prompts (60 tokens of tool definitions, 8 of template a message), as sent:
#   1: s u                          60 + 150 + 2*8   =  226
#   2: + a t1000                    60 + 1160 + 4*8  = 1252
#   3: + a t50                      60 + 1220 + 6*8  = 1328
#   4: + a t2000                    60 + 3230 + 8*8  = 3354
#   5: + a t600                     60 + 3840 + 10*8 = 3980
#   6: + a t300                     60 + 4150 + 12*8 = 4306
# Savings: 1000 - STUB, 50: none (under over_tokens), 2000 - STUB, 600 - STUB (276), 300: none (the stub is larger).
# keep_last 1, batch 1500: at step 5 the outputs 1000, 50 and 2000 leave the newest one and save 676 + 1676 at
# once: 1000 and 2000 become stubs; at step 6, 600 leaving saves 276 < 1500: the frontier stays.
OUTPUTS = [1000, 50, 2000, 600, 300]
SENT = [226, 1252, 1328, 3354, 3980, 4306]
SAVED = (1000 - STUB) + (2000 - STUB)
RECEIVED = [226, 1252, 1328, 3354, 3980 - SAVED, 4306 - SAVED]


@pytest.fixture
def data(tmp_path: Path) -> str:
    path = tmp_path / "sessions.jsonl.gz"
    sessions = [_session(OUTPUTS), _session([30, 40])]  # the second: nothing worth masking, 3 steps
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in sessions)
    return str(path)


def _rule() -> MaskRule:
    return masking_replay.parse_rule(RULE, MaskRule())


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["--policy", POLICY, *args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_each_steps_received_prompt_is_the_one_worked_out_by_hand() -> None:
    messages = _session(OUTPUTS)["messages"]
    sent = [chain_of_record(messages[:i])[-1].tokens for i, _ in steps_of(messages)]
    got = [chain_of_record(received(messages[:i], _rule()))[-1].tokens for i, _ in steps_of(messages)]
    assert sent == SENT
    assert got == RECEIVED


def test_without_batching_the_frontier_moves_at_each_output_worth_it() -> None:
    """batch_tokens 0: 1000 masked at step 3, 2000 at step 5, 600 (saving 276) at step 6."""
    messages = _session(OUTPUTS)["messages"]
    rule = masking_replay.parse_rule("batch_tokens=0", _rule())
    got = [chain_of_record(received(messages[:i], rule))[-1].tokens for i, _ in steps_of(messages)]
    assert got == [226, 1252, 1328 - (1000 - STUB), 3354 - (1000 - STUB), 3980 - SAVED, 4306 - SAVED - (600 - STUB)]


def test_the_cli_prints_the_hand_worked_figures(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--data", data, "--rule", RULE)
    rows = {r["routing"]: r for r in out["rows"]}
    masked, unmasked, fast = rows["auto, managed"], rows["auto, unmanaged"], rows["fast, managed"]
    sent = sum(SENT) + 226 + 282 + 348  # the second session's steps: s u, + a t30, + a t40
    assert masked["steps"] == unmasked["steps"] == fast["steps"] == 9
    assert masked["sent_tokens"] == unmasked["sent_tokens"] == sent
    assert masked["received_tokens"] == fast["received_tokens"] == sent - 2 * SAVED
    assert masked["received_over_sent"] == pytest.approx((sent - 2 * SAVED) / sent)
    assert unmasked["received_tokens"] == sent and unmasked["received_over_sent"] == 1.0
    assert masked["prefix_moved_steps"] == 1 and unmasked["prefix_moved_steps"] == 0
    # Every step on fast: each step prefills what it adds, but step 5 everything after the first stub, which
    # follows s, u and an assistant turn (60 + 100+8 + 50+8 + 10+8 = 244 tokens); unmanaged, the last prompts.
    one = 226 + (1252 - 226) + (1328 - 1252) + (3354 - 1328) + (RECEIVED[4] - 244) + (RECEIVED[5] - RECEIVED[4])
    assert fast["prefilled_tokens"] == one + 348
    assert fast["prefilled_vs_unmanaged_one"] == pytest.approx((one + 348) / (4306 + 348))
    assert fast["fast_share"] == 1.0
    assert out["rules"]["mask_tool_outputs"] == {"keep_last": 1, "over_tokens": 200, "batch_tokens": 1500,
                                                  "head_chars": 400, "tail_chars": 400}


def test_the_window_counts_received_prompts_over_it(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["routing"]: r for r in _run(capsys, "--data", data, "--rule", RULE, "--window", "3000")["rows"]}
    assert rows["auto, unmanaged"]["over_window_steps"] == 3  # 3354, 3980, 4306
    # 3354 (step 4, before the frontier moved) is fitted as the gateway fits a step over every window: by the
    # second of FIT_RULES (keep_last 1), the 1000-token output given way to a 424-token stub: 2778
    assert rows["auto, managed"]["over_window_steps"] == 0
    assert _run(capsys, "--data", data, "--rule", RULE)["window"] is None  # long-runs.yaml sets no max_model_len


def test_the_sweep_holds_the_grid_and_agrees_with_the_replay(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--data", data, "--rule",
               "keep_last=1,over_tokens=200,batch_tokens=0,head_chars=200,tail_chars=200", "--sweep")
    grid = {(r["rule"]["keep_last"], r["rule"]["batch_tokens"], r["rule"]["head_chars"]): r for r in out["sweep"]}
    assert set(grid) == {(k, b, c) for k in (1, 3) for b in (0, 2000, 4000, 8000) for c in (200, 600)}
    same = grid[(1, 0, 200)]
    assert same["received_over_sent"] == out["rows"][0]["received_over_sent"] < 1.0
    assert same["prefix_moved_share"] == out["rows"][0]["prefix_moved_share"]
    assert grid[(1, 8000, 600)]["received_over_sent"] == 1.0  # the savings never reach 8000 at once


def test_a_masked_output_reads_the_same_stub_at_every_later_step() -> None:
    """On the first committed sessions, by the rule that masks the most: every stub stays where it was, the same,
    and the frontier never moves back."""
    rule = MaskRule(keep_last=1, over_tokens=200, batch_tokens=0, head_chars=200, tail_chars=200)
    checked = 0
    for session in read_sessions(str(DATA), 20):
        messages = session["messages"]
        before: list[list[Any]] = []
        for index, _ in steps_of(messages):
            now = received(messages[:index], rule)
            stubs_before = {i: m for i, m in enumerate(before) if m[2] != messages[i][2]}
            assert all(now[i] == m for i, m in stubs_before.items())
            checked += len(stubs_before)
            before = now
    assert checked > 1000


def test_masking_off_receives_what_was_sent(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--limit", "20")
    rows = {r["routing"]: r for r in out["rows"]}
    masked, unmasked = rows["auto, managed"], rows["auto, unmanaged"]
    assert out["rules"] == {  # policies/long-runs.yaml's
        "mask_tool_outputs": {"keep_last": 1, "over_tokens": 4000, "batch_tokens": 0, "head_chars": 600,
                              "tail_chars": 600},
        "summarize_old_turns": {"over_tokens": 12000, "keep_tokens": 1000, "summary_tokens": 512}}
    assert unmasked["received_tokens"] == unmasked["sent_tokens"] == masked["sent_tokens"]
    assert masked["received_tokens"] < masked["sent_tokens"]
    assert masked["steps"] == unmasked["steps"] > 20
    assert 0 < masked["prefix_moved_share"] < 0.1


def test_the_stub_estimate_is_near_the_gateways_own_stub() -> None:
    """STUB_FRAME_TOKENS and CHARS_PER_TOKEN against stub_of on this repository's code, counted in cl100k: within
    a tenth over all, a fifth each (the stub's format or its reference growing would show here)."""
    encoding = load_encoding()
    assert encoding is not None
    estimated = actual = 0
    for chars in (200, 600):
        rule = MaskRule(head_chars=chars, tail_chars=chars)
        for path in ("gateway/context/masking.py", "gateway/features/__init__.py", "gateway/policy/model.py",
                     "gateway/decision/routing.py", "evals/session_cache/replay.py"):
            text = "<returncode>1</returncode>\n<output>\n" + (ROOT / path).read_text() + "\n</output>"
            stub = len(encoding.encode_ordinary(stub_of(text, None, chars, chars).text))
            estimate = stub_tokens(len(encoding.encode_ordinary(text)), rule)
            assert abs(estimate - stub) <= stub / 5, (path, chars, estimate, stub)
            estimated, actual = estimated + estimate, actual + stub
    assert abs(estimated - actual) <= actual / 10


def test_a_bad_rule_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", POLICY, "--rule", "keep=3"]) == 2
    assert "keep_last=N" in capsys.readouterr().err
    assert main(["--policy", str(ROOT / "policies" / "default.yaml"), "--limit", "1"]) == 2  # it masks nothing


# Old turns summarized (over 2000, keep 700, a summary of 100), the same session, entries after s and u:
#   step 4 (… a t2000): 3080 > 2000: the span ends before the a of t2000 (index 6; that turn alone is over 700)
#   step 5 (… a): 2010 + 10 + the summary's 100 > 2000: the span ends before that a (index 8)
# A summary is written after the step whose span moved and sent from the next: step 5 reads the one through
# index 6, step 6 the one through index 8; each is asked as the next turn of the prompt the step before read.
EVICT = "over_tokens=2000,keep_tokens=700,summary_tokens=100"
ASK = masking_replay.ASK_TOKENS
SUMMARIZED = [226, 1252, 1328, 3354,
              60 + (100 + 50 + 100 + 10 + 2000 + 10 + 600) + 7 * 8,  # s u S a t2000 a t600
              60 + (100 + 50 + 100 + 10 + 600 + 10 + 300) + 7 * 8]  # s u S a t600 a t300
SUMMARY_PROMPTS = [60 + (100 + 50 + 10 + 1000 + 10 + 50 + ASK) + 7 * 8,  # s u a t1000 a t50, the ask
                   60 + (100 + 50 + 100 + 10 + 2000 + ASK) + 6 * 8]  # s u S a t2000, the ask


def test_old_turns_give_way_to_a_summary_one_step_after_their_span_moved() -> None:
    messages = _session(OUTPUTS)["messages"]
    evict = masking_replay.parse_evict(EVICT, None)
    got = [chain_of_record(masking_replay.managed(messages[:i], None, evict))[-1].tokens
           for i, _ in steps_of(messages)]
    assert got == SUMMARIZED
    asked = [masking_replay.summary_prompt(messages[:i], None, evict) for i, _ in steps_of(messages)]
    assert [chain_of_record(a)[-1].tokens for a in asked if a is not None] == SUMMARY_PROMPTS
    assert [a is not None for a in asked] == [False] * 4 + [True] * 2


def test_the_cli_counts_the_summaries_and_their_prompts(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--data", data, "--summarize", EVICT)
    rows = {r["routing"]: r for r in out["rows"]}
    managed, fast = rows["auto, managed"], rows["fast, managed"]
    assert out["rules"]["summarize_old_turns"] == {"over_tokens": 2000, "keep_tokens": 700, "summary_tokens": 100}
    assert managed["summaries_per_session"] == 1.0  # two in the first session, none in the second
    # long-runs.yaml masks too (keep_last 3, batch 4000: nothing here is worth a batch): what fast received is
    # the steps as summarized and the summaries' prompts
    sent = sum(SENT) + 226 + 282 + 348
    assert fast["received_tokens"] == sum(SUMMARIZED) + sum(SUMMARY_PROMPTS) + 226 + 282 + 348
    assert fast["summary_prompt_share"] == pytest.approx(sum(SUMMARY_PROMPTS) / fast["received_tokens"])
    assert rows["auto, unmanaged"]["received_tokens"] == sent


def test_a_bad_summarize_rule_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", POLICY, "--summarize", "over_tokens=1000,keep_tokens=900"]) == 2
    assert "over_tokens must be more" in capsys.readouterr().err
