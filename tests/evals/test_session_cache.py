"""`python -m evals.session_cache` on the first sessions of the committed set: the switch price keeps sessions
on their cache (fewer switches, less prefilled again) where the rules alone flapped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_replay_prints_each_routings_figures() -> None:
    done = subprocess.run([sys.executable, "-m", "evals.session_cache", "--limit", "40", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    rows = {row["routing"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"auto before", "auto after", "hq", "fast", "free-switch bound"}
    before, after = rows["auto before"], rows["auto after"]
    assert before["steps"] == after["steps"] == rows["hq"]["steps"] > 40
    assert rows["hq"]["prefilled_vs_one"] == rows["fast"]["prefilled_vs_one"] == 1.0
    assert rows["hq"]["hq_share"] == 1.0 and rows["fast"]["fast_share"] == 1.0
    assert rows["free-switch bound"]["prefilled_vs_one"] == 1.0
    assert rows["free-switch bound"]["fast_share"] == before["fast_share"]
    assert after["switches_per_session"] < before["switches_per_session"] / 2
    assert after["prefilled_vs_one"] < before["prefilled_vs_one"]
    assert after["prefilled_vs_one"] <= 1.15 and after["fast_share"] >= 0.6 and after["hq_share"] >= 0.05


def test_the_table_names_every_routing() -> None:
    done = subprocess.run([sys.executable, "-m", "evals.session_cache", "--limit", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    for name in ("auto before", "auto after", "hq", "fast", "free-switch bound"):
        assert name in done.stdout
