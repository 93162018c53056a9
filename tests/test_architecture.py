"""The package map holds: imports only go down the layers, the pure core imports no I/O library, no cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
# Lowest first: a module may import its own package and the packages before it, never one after it.
LAYERS = ["frozen", "errors", "api_formats", "native", "features", "agents", "context",
          "classifier", "rollout", "policy", "agent_judging", "decision", "apis", "store", "upstream", "telemetry",
          "agent_runtime", "accounting", "experiments", "server", "cli"]
# Two folders span layers, each part where what it reads puts it. An API's folder under gateway/apis/ holds its
# formats (checks, views, usage, stream readers, errors: read by features, context and accounting, so low) and its
# adapter (which reads the decision's view, so high); the route table and the compaction the Responses adapter
# answers with sit with the adapters. The agent runtime (gateway/agents/) reads a step (low: context and the
# decision read it), judges a trajectory by the policy's agents section (loops, spikes) and records sessions at
# run time (with the stores, metrics and rollout cohorts).
API_ADAPTERS = {"gateway.apis.adapter", "gateway.apis.routes", "gateway.apis.responses.compaction"}
AGENT_LAYERS = {"gateway.agents.loops": "agent_judging", "gateway.agents.spikes": "agent_judging",
                "gateway.agents.recorder": "agent_runtime", "gateway.agents.pending_steps": "agent_runtime",
                "gateway.agents.outcome_reports": "agent_runtime"}
PURE = {"frozen", "errors", "api_formats", "native", "features", "agents", "context", "classifier",
        "rollout", "policy", "agent_judging", "decision", "apis"}
# pure halves that live beside their runtime: reading back a broken stream and splicing its continuation
PURE_MODULES = {"gateway.server.resume_splice"}
# the pure core also runs no tasks, threads, sockets or processes of its own: that belongs to the runtime
IO_LIBRARIES = ("aiohttp", "redis", "opentelemetry", "prometheus_client", "asyncio", "os", "socket", "threading")
# One module per foreign library translates its errors and owns its objects.
OWNERS = {"redis": {"gateway.store.redis_store"}, "obstore": {"gateway.store.s3_objects"},
          "prometheus_client": {"gateway.telemetry.metrics"}}


def _modules() -> dict[str, Path]:
    found = {}
    for path in GATEWAY.rglob("*.py"):
        parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[str]:
    """Every module an import statement anywhere in the file names (TYPE_CHECKING and function-level too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in MODULES else node.module


def _layer(module: str) -> str:
    if module in AGENT_LAYERS:
        return AGENT_LAYERS[module]
    if module.startswith("gateway.apis.") and module not in API_ADAPTERS and not module.endswith(".adapter"):
        return "api_formats"
    return module.split(".")[1] if module.count(".") else ""


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_every_package_is_in_a_layer() -> None:
    packages = {_layer(m) for m in MODULES} - {"", "__main__"}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS"


def test_imports_only_go_down() -> None:
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets
              if _layer(a) in LAYERS and _layer(b) in LAYERS and LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))]
    assert upward == []


def test_the_pure_core_imports_no_io_library() -> None:
    found = [f"{name} imports {imported}" for name, path in MODULES.items()
             if _layer(name) in PURE or name in PURE_MODULES
             for imported in _imports(path) if imported.split(".")[0] in IO_LIBRARIES]
    assert found == []


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_one_module_owns_each_library(library: str) -> None:
    users = {name for name, path in MODULES.items() if any(m.split(".")[0] == library for m in _imports(path))}
    assert users == OWNERS[library]


def test_no_import_cycles() -> None:
    graph = _graph()
    # a package's __init__ re-exporting its own submodule is not a cycle of meaning
    graph = {a: {b for b in targets if not (a == b.rpartition(".")[0] and MODULES[a].name == "__init__.py")}
             for a, targets in graph.items()}
    assert [cycle for root in sorted(graph) if (cycle := _cycle_from(root, graph, [], set()))] == []


def _cycle_from(node: str, graph: dict[str, set[str]], path: list[str], done: set[str]) -> list[str]:
    """A cycle reachable from `node` as the list of its modules, else [] (depth first; the graph is small)."""
    if node in path:
        return [*path[path.index(node):], node]
    if node in done:
        return []
    for child in sorted(graph[node]):
        if cycle := _cycle_from(child, graph, [*path, node], done):
            return cycle
    done.add(node)
    return []


def test_the_product_imports_no_test_or_benchmark_code() -> None:
    """gateway/ and serving/ are what is installed; bench/, fakes/ and tests/ are not, so the product needs none."""
    found = [f"{path.relative_to(GATEWAY.parent)} imports {imported}"
             for package in ("gateway", "serving") for path in (GATEWAY.parent / package).rglob("*.py")
             for imported in _imports(path) if imported.split(".")[0] in ("bench", "fakes", "tests")]
    assert found == []


# docs/layout.md: one concern seen from several layers keeps its name in each, and each API folder has its wire
# and adapter; any other module name that repeats across packages is a defect.
SHARED_NAMES = {"tenancy", "context", "compaction", "rollouts", "labels", "shares", "switch", "conversations",
                "explain", "retrieval", "wire", "adapter"}


def test_a_module_name_repeats_across_packages_only_for_a_concern_seen_from_several_layers() -> None:
    seen: dict[str, list[str]] = {}
    for path in GATEWAY.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(str(path.relative_to(GATEWAY)))
    repeated = {name: places for name, places in seen.items() if len(places) > 1 and name not in SHARED_NAMES}
    assert not repeated, f"module names repeated across packages (docs/layout.md): {repeated}"
