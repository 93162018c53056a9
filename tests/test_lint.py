"""The tree stays clean under the project's ruff and mypy configurations (pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "gateway", "serving", "bench", "fakes", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_is_clean() -> None:
    """The package and the benchmarks type-check under mypy --strict with pydantic's plugin (pyproject.toml)."""
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
