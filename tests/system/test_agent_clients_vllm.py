"""The cpu pair takes a coding agent's turn: Codex CLI and Claude Code straight to real vLLM (no gateway).

Slow (the session's real pair, see tests/fixtures/vllm_pair.py): run with the other real-vLLM tests.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.fixtures import agent_clients
from tests.fixtures.vllm_pair import VllmPair

# A turn's time is reported (printed here, measured in the README), not asserted: on this machine hq took Codex's
# first turn in 60-78 s, and in a CI run 220 s. The bound only stops a client that hangs.
TURN_HANG_S = 600.0
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3 * TURN_HANG_S)]


def test_an_answer_without_a_limit_stops_at_the_default_and_a_limit_asked_for_wins(vllm_pair: VllmPair) -> None:
    """The tiny model's generation config is a default (512 tokens), not a cap: Claude Code reads an answer cut
    below the max_tokens it asked for as a failure and retries with more."""
    client = openai.OpenAI(base_url=vllm_pair.fast.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Write a long story."}]
    unbounded = client.chat.completions.create(
        model=vllm_pair.fast.served_model, messages=messages, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert unbounded.usage is not None and unbounded.usage.completion_tokens == 512
    asked = client.chat.completions.create(
        model=vllm_pair.fast.served_model, messages=messages, max_tokens=700,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    assert asked.usage is not None and asked.usage.completion_tokens == 700


@pytest.mark.parametrize("deployment", ["fast", "hq"])
async def test_codex_completes_a_turn_and_the_next_turn_is_faster(
    vllm_pair: VllmPair, deployment: str, tmp_path: Path
) -> None:
    target = vllm_pair[deployment]
    first = await agent_clients.codex_exec(target.base_url, "Say hello.", tmp_path, model=target.served_model,
                                           timeout_s=TURN_HANG_S)
    assert first.exit_code == 0, first.describe()
    assert [e["type"] for e in first.events()][-1] == "turn.completed"
    started = time.monotonic()
    later = await agent_clients.codex_exec(target.base_url, "Now say goodbye.", tmp_path,
                                           model=target.served_model, resume=True, timeout_s=TURN_HANG_S)
    assert later.exit_code == 0, later.describe()
    usage = next(e["usage"] for e in later.events() if e["type"] == "turn.completed")
    assert usage["cached_input_tokens"] > 10_000  # the instructions and tools came from the prefix cache
    print(f"codex on {deployment}: first turn {first.seconds:.1f} s, next {time.monotonic() - started:.1f} s")


async def test_claude_code_completes_a_turn(vllm_pair: VllmPair, tmp_path: Path) -> None:
    """Its first request is ~14k of the pair's tokens with max_tokens 32000, more than the window leaves: vLLM
    generates at most what is left. The answer runs until the random model stops (140 to 3,800 tokens seen), which fast
    decodes within the bound; on hq that took 2 to 5 minutes (see the README), so hq is not asserted here.
    No CLAUDE_CODE_MAX_OUTPUT_TOKENS: Claude Code takes an answer cut at max_tokens for a failed turn."""
    target = vllm_pair.fast
    run = await agent_clients.claude_print(target.url, "Say hello.", tmp_path, model=target.served_model,
                                           timeout_s=TURN_HANG_S)
    assert run.exit_code == 0, run.describe()
    result = next(e for e in run.events() if e.get("type") == "result")
    usage = result["usage"]  # Anthropic's input_tokens leaves out what the prefix cache read
    prompt = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    assert result["is_error"] is False and prompt > 10_000  # its system prompt and tool set: 13,966 in a CI run
    print(f"claude code on fast: first turn {run.seconds:.1f} s")
