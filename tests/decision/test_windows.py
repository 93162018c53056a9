"""Windows in the deployment's own tokens (decision/windows.py): the bound far from a window, the deployment's
count near it, the step moved to a deployment it fits, refused when none does, its output cap clamped."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gateway.decision import windows
from gateway.decision.routing import Context, DeploymentLoad, decide
from gateway.decision.windows import Count, Fit
from gateway.errors import ContextTooLong
from gateway.features import BYTES_PER_TOKEN_ESTIMATE, TEMPLATE_TOKENS_PER_MESSAGE, Features, extract
from gateway.policy import model as policy_module

POLICY = policy_module.parse((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
HEALTHY = {"hq": DeploymentLoad(), "fast": DeploymentLoad()}


def _features(text: str = "hello", **body: Any) -> Features:
    return extract({"model": "auto", "messages": [{"role": "user", "content": text}], **body}, "chat")


@pytest.mark.parametrize(("configured", "learned", "window"), [
    (None, None, None), (4096, None, 4096), (None, 32768, 32768),
    (8192, 32768, 8192),  # the policy keeps room back
    (65536, 32768, 32768),  # a policy wider than the deployment would only earn its 400
])
def test_the_window_is_the_deployments_narrowed_by_the_policy(
    configured: int | None, learned: int | None, window: int | None
) -> None:
    assert windows.window_of(configured, learned) == window


def test_the_bound_is_the_cl100k_count_times_the_ratio_or_the_bytes_when_the_count_was_estimated() -> None:
    short = _features("word " * 100)
    assert short.prompt_tokens_exact
    wrapping = TEMPLATE_TOKENS_PER_MESSAGE * 2
    assert windows.prompt_bound(short) == math.ceil(short.prompt_tokens * windows.TOKENS_PER_CL100K_MAX) + wrapping
    long = _features("x" * 40_000)  # past the exact-count budget: estimated from bytes
    assert not long.prompt_tokens_exact
    assert windows.prompt_bound(long) == long.prompt_tokens * BYTES_PER_TOKEN_ESTIMATE + wrapping >= 40_000
    tools = _features("hi", tools=[{"type": "function", "function": {"name": "f"}}])
    assert windows.prompt_bound(tools) - windows.prompt_bound(_features("hi")) >= windows.TOOLS_TEMPLATE_TOKENS


@pytest.mark.parametrize(("words", "max_tokens", "window", "near"), [
    (100, None, 32768, False),  # far: no count needed
    (100, 32000, 32768, False),  # ~150 + 32,000 < 32,768
    (100, 32700, 32768, True),  # the cap would reach past the window by the bound
    (3000, None, 4096, True),  # ~3,000 cl100k is 4,500 by the bound: only a count can say
    (3000, None, None, False),  # no window known: nothing to fit
])
def test_only_a_prompt_near_the_edge_is_counted_by_the_deployment(
    words: int, max_tokens: int | None, window: int | None, near: bool
) -> None:
    features = _features("word " * words, **({"max_tokens": max_tokens} if max_tokens else {}))
    assert windows.near_edge(window, features) is near


@pytest.mark.parametrize(("tokens", "max_tokens", "window", "fits", "cap"), [
    (1000, None, 4096, True, None),
    (1000, 500, 4096, True, None),
    (4000, 500, 4096, True, 96),  # clamped to the room
    (4090, None, 4096, False, None),  # fewer than 16 tokens left: no useful answer
    (4090, 4, 4096, True, None),  # ... unless the call asks for fewer itself
    (5000, 500, 4096, False, 0),
])
def test_fit_by_the_deployments_count(
    tokens: int, max_tokens: int | None, window: int, fits: bool, cap: int | None
) -> None:
    features = _features(**({"max_tokens": max_tokens} if max_tokens else {}))
    found = windows.fit(window, features, Count(tokens, True))
    assert (found.fits, found.cap, found.prompt_tokens, found.counted) == (fits, cap, tokens, True)


def test_the_budgets_cap_and_the_windows_cap_are_merged_to_the_smaller() -> None:
    fits = {"hq": Fit(32768, 30000, True, True, 2768), "fast": Fit(32768, 100, True, True, None)}
    assert windows.caps(None, fits) == {"hq": 2768}
    assert windows.caps({"hq": 1000, "fast": 900}, fits) == {"hq": 1000, "fast": 900}
    assert windows.caps({"hq": 5000, "fast": 900}, fits) == {"hq": 2768, "fast": 900}
    assert windows.caps({"fast": 900}, {}) == {"fast": 900}


def _fits(features: Features, counts: dict[str, int], windows_: dict[str, int]) -> dict[str, Fit]:
    return windows.fits_of(POLICY, features, windows_, {n: Count(c, True) for n, c in counts.items()})


def test_a_step_that_fits_fast_by_cl100k_but_not_by_its_tokenizer_goes_to_hq_saying_why() -> None:
    features = _features("word " * 3000)  # 3,000 cl100k tokens: below fast's 4,096 by cl100k
    assert features.prompt_tokens < 4096
    fits = _fits(features, {"fast": 6500, "hq": 6500}, {"fast": 4096, "hq": 32768})
    decision = decide(POLICY, features, Context(load=HEALTHY, fits=fits), explain=True)
    assert decision.deployment == "hq" and decision.attempts == ("hq",)
    skipped = next(r for r in decision.reasons if r.startswith("skip fast"))
    assert "fast's window of 4,096 tokens holds a prompt of 6,500 (counted by its tokenizer)" in skipped


def test_a_step_that_fits_no_deployment_is_refused_with_a_400_naming_the_windows() -> None:
    features = _features("word " * 3000)
    fits = _fits(features, {"fast": 40000, "hq": 40000}, {"fast": 4096, "hq": 32768})
    with pytest.raises(ContextTooLong) as refused:
        decide(POLICY, features, Context(load=HEALTHY, fits=fits))
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert "hq's window of 32,768 tokens holds a prompt of 40,000" in refused.value.message


def test_a_max_tokens_past_the_room_is_clamped_to_it_and_said() -> None:
    features = _features("word " * 100, max_tokens=32000)
    fits = _fits(features, {"fast": 20000, "hq": 20000}, {"fast": 32768, "hq": 32768})
    decision = decide(POLICY, features, Context(load=HEALTHY, fits=fits))
    assert fits[decision.deployment].cap == 12768
    assert f"context: max_tokens 32,000 clamped to 12,768: {decision.deployment}'s window" in "".join(decision.reasons)


def test_a_deployment_far_from_its_window_is_judged_by_the_bound_without_a_count() -> None:
    features = _features("word " * 100, max_tokens=1000)
    fits = _fits(features, {}, {"fast": 32768, "hq": 32768})
    assert all(f.fits and f.cap is None and not f.counted for f in fits.values())
    assert decide(POLICY, features, Context(load=HEALTHY, fits=fits)).deployment == "fast"


CODEX_COMPACT = ("You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for another LLM that "
                 "will resume the task.")
CLAUDE_SUMMARY = ("Your task is to create a detailed summary of the conversation so far, paying close attention to "
                  "the user's explicit requests and your previous actions.")


@pytest.mark.parametrize(("instruction", "asker"), [(CODEX_COMPACT, "codex"), (CLAUDE_SUMMARY, "claude-code")])
def test_an_agents_own_compaction_request_goes_to_the_largest_window(instruction: str, asker: str) -> None:
    """Both fit fast, which the rules pick for a plain prompt; the summary request still goes to hq's larger window."""
    history = [{"role": "user", "content": "word " * 500}, {"role": "assistant", "content": "done"}]
    plain = extract({"model": "auto", "messages": [*history, {"role": "user", "content": "and now?"}]}, "chat")
    compaction = extract({"model": "auto", "messages": [*history, {"role": "user", "content": instruction}]}, "chat")
    fits = {"fast": 16384, "hq": 32768}
    chosen = decide(POLICY, plain, Context(load=HEALTHY, fits=_fits(plain, {}, fits)), explain=True)
    assert chosen.deployment == "fast"
    asked = decide(POLICY, compaction, Context(load=HEALTHY, fits=_fits(compaction, {}, fits)), explain=True)
    assert asked.deployment == "hq" and asked.attempts[0] == "hq"
    assert f"agent compaction: {asker}'s summary request goes to hq, the largest window (32,768 tokens)" in \
        asked.reasons


def test_an_agents_compaction_request_stays_where_the_larger_window_cannot_take_it() -> None:
    compaction = _features(CODEX_COMPACT)
    load = {"hq": DeploymentLoad(healthy=False), "fast": DeploymentLoad()}
    fits = _fits(compaction, {}, {"fast": 16384, "hq": 32768})
    assert decide(POLICY, compaction, Context(load=load, fits=fits)).deployment == "fast"


def test_the_instruction_is_recognized_only_where_it_opens_the_last_message() -> None:
    from gateway.decision.agent_compaction import compaction_asker

    assert compaction_asker("  " + CODEX_COMPACT + " more") == "codex"
    assert compaction_asker("Please explain this:\n" + "x" * 500 + CLAUDE_SUMMARY) is None
    assert compaction_asker("fix the failing test") is None


# How Claude Code 2.1.332 opens its summary request (captured through the gateway): a no-tools preamble first.
CLAUDE_2_1_332_SUMMARY = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n- Do NOT use Read, Bash, Grep, Glob, Edit, Write, "
    "or ANY other tool.\n- You already have all the context you need in the conversation above.\n- Tool calls will "
    "be REJECTED and will waste your only turn \u2014 you will fail the task.\n- Your entire response must be plain "
    "text: an <analysis> block followed by a <summary> block.\n\n" + CLAUDE_SUMMARY + "\nThis summary should be "
    "thorough in capturing technical details, code patterns, and architectural decisions."
)


def test_claude_codes_summary_request_is_recognized_behind_its_no_tools_preamble() -> None:
    from gateway.decision.agent_compaction import compaction_asker

    assert compaction_asker(CLAUDE_2_1_332_SUMMARY) == "claude-code"
    # the preamble alone is any client's "answer in text"
    assert compaction_asker(CLAUDE_2_1_332_SUMMARY.split("\n\n")[0] + "\n\nWhat does this file do?") is None
