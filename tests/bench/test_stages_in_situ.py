"""The in-situ stage benchmark names stages that exist, and its timers count what they wrap."""

from __future__ import annotations

import importlib

from bench import stages_in_situ
from gateway.features import has_code


def test_every_stage_names_a_function_of_the_request_path() -> None:
    for module_name, qualified, depth in stages_in_situ.STAGES:
        found: object = importlib.import_module(module_name)
        for part in qualified.split("."):
            found = getattr(found, part)
        assert callable(found), qualified
        assert depth in (0, 1, 2)


def test_a_timed_stage_returns_what_it_returned_and_counts_its_calls() -> None:
    tally = [0, 0]
    timed = stages_in_situ._timed(has_code, tally)
    assert timed("\ndef f():\n    return 1") is True
    assert timed("plain prose") is False
    assert tally[1] == 2 and tally[0] > 0
