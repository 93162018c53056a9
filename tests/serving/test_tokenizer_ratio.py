"""The tiny family's tokenizer counts agent text close to cl100k: `up`'s windows hold a coding agent's turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving import tiny_model, tokenizer_ratio

# A coding agent's first turn with its full tool set (DESIGN.md): Codex's ~9.4k cl100k tokens, Claude Code's ~19k.
CLAUDE_CODE_FIRST_TURN_CL100K = 19_000
MAX_RATIO = 1.3


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny")) / "small" / "tokenizer.json"


def test_the_family_counts_agent_text_within_1_3x_of_cl100k(tokenizer_file: Path) -> None:
    ours, cl100k, ratio = tokenizer_ratio.ratio(tokenizer_file, tokenizer_ratio.read_sample())
    assert cl100k > 5_000  # the sample is a whole turn's worth of text, not a sentence
    assert ratio == ours / cl100k <= MAX_RATIO, f"{ours} family tokens for {cl100k} cl100k ones: {ratio:.3f}x"


def test_claude_codes_first_turn_fits_ups_window_at_that_ratio(tokenizer_file: Path) -> None:
    from serving.profile import load

    _, _, ratio = tokenizer_ratio.ratio(tokenizer_file, tokenizer_ratio.read_sample())
    for _, dep in load("cpu").deployments.items():
        assert CLAUDE_CODE_FIRST_TURN_CL100K * ratio < dep.max_model_len


def test_the_command_prints_the_ratio(tokenizer_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tokenizer_ratio.main(["--tokenizer", str(tokenizer_file)]) == 0
    printed = capsys.readouterr().out
    assert "agent_text.txt" in printed and printed.rstrip().endswith("x")
