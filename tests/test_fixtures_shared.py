"""A shared fixture is one object: a test module that binds a plugin's fixture to a name of its own gets its own
copy of it, and a session-scoped copy its own session (one CI run kept a second vLLM pair running that way)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _fixture_names() -> set[str]:
    """The fixtures tests/fixtures/ defines (the plugins tests/conftest.py registers)."""
    names = set()
    for path in (TESTS / "fixtures").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list
            ):
                names.add(node.name)
    return names


def test_no_test_module_binds_a_plugins_fixture_again() -> None:
    fixtures = _fixture_names()
    assert "vllm_supervisor" in fixtures
    rebound = []
    for path in TESTS.rglob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr in fixtures:
                rebound.append(f"{path.relative_to(TESTS)}:{node.lineno} {ast.unparse(node)}")
    assert not rebound, "use the plugin's fixture by its name instead: " + "; ".join(rebound)
