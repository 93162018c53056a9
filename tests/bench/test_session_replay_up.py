"""The `up` replay's session: real outputs of this repository, growing a call a step, distinct per routing."""

from __future__ import annotations

import itertools

from bench.session_replay_up import COMMANDS, commands, render, session, tool_times


def test_each_step_resends_the_last_plus_one_call_and_its_real_output() -> None:
    steps = session(6, 300, "# run after")
    assert [len(s) for s in steps] == [2 + 2 * n for n in range(1, 7)]
    for before, after in itertools.pairwise(steps):
        assert after[:len(before)] == before  # an agent re-sends its conversation: the prefix cache can hit
    results = [m["content"] for m in steps[-1] if m["role"] == "tool"]
    assert results[0].startswith("Exit code: 0\nOutput:\n") and len(results[0]) <= 300 + 30
    assert COMMANDS[4] is None and results[4].startswith("Exit code: 1\n") and "1 failed" in results[4]
    assert "gateway" in results[1]  # `ls gateway gateway/decision`, run for real


def test_routings_share_no_prefix() -> None:
    first, second = session(1, 100, "# run before")[0], session(1, 100, "# run hq")[0]
    assert first[0]["content"] != second[0]["content"] and first[0]["content"].startswith("# run before\n")


def test_the_table_names_each_step_and_the_caches() -> None:
    row = {"routing": "after", "steps": [("fast", 0.120), ("hq", 0.980)], "ttft_sum_s": 1.1,
           "prefix_cache": {"hq": (2048.0, 4096.0), "fast": (0.0, 1024.0)}, "warmups": {"hq done": 1.0}}
    table = render([row, {**row, "routing": "fast", "warmups": {}}])
    assert "f120 h980" in table and "1100 ms" in table and "hq 2,048 / 4,096, fast 0 / 1,024" in table
    assert table.splitlines()[1].endswith("hq done 1") and table.splitlines()[2].endswith("none")


def test_failing_twice_runs_each_failing_pytest_again_and_waits_for_it() -> None:
    run = commands(True)
    assert run.count(None) == 2 * COMMANDS.count(None) and [c for c in run if c is not None] == [
        c for c in COMMANDS if c is not None]
    first = run.index(None)
    assert run[first + 1] is None
    waits = tool_times(len(run), True, 1.0, 150.0)
    assert waits[first - 1] == waits[first] == 150.0 and waits[first + 1] == 1.0  # before each pytest result
    steps = session(first + 2, 200, "# run after", failing_twice=True)
    assert [m["content"].startswith("Exit code: 1") for m in steps[-1] if m["role"] == "tool"][-2:] == [True, True]
    assert tool_times(4, False, 2.0, 150.0) == [2.0, 2.0, 2.0, 150.0]
