"""The package's import graph, read from the source with ``ast``: no cycles, and every import points down the
layers protocol -> encoding -> vision -> model -> engine -> server -> scale -> CLI and the serve command.

Every import counts: module level, inside functions and under ``TYPE_CHECKING`` (a function-level import is
still a dependency; it only hides a cycle until the function runs).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "clef_runtime"
ROOT = Path(__file__).resolve().parent.parent / "src" / PACKAGE

# Rank of each part of the package: an import may only go to the same rank or lower.
# version, options, release (a checkpoint's file layout), shards (the one shard reader), logs (the log
# format) and heap_trim (giving the C heap's free pages back: a process tool) are leaves every layer may
# read; the package root re-exports the engine's Clef. jobs (the durable job store and the runner that feeds
# the engine's background lane) sits with the engine; evaluation
# (measuring a loaded engine on labelled cases) and tuning (training a head on them) sit with the server.
# scale (Ray Serve replicas and routing) is built from the server's runtime, above it: the server never knows
# how it is scaled out; batch (`clef batch`: bulk decisions in this process or on Ray Data) sits with scale,
# from whose Ray options it takes its pool's. The entry points (the CLI, the serve command, the quick bench,
# the health probe) are on top.
RANKS = {
    "version": 0,
    "options": 0,
    "release": 0,
    "shards": 0,
    "logs": 0,
    "heap_trim": 0,
    "protocol": 1,
    "encoding": 2,
    "vision": 3,
    "model": 4,
    "engine": 5,
    "jobs": 5,
    "server": 6,
    "evaluation": 6,
    "tuning": 6,
    "scale": 7,
    "batch": 7,
    "cli": 8,
    "serve_command": 8,
    "mcp_command": 8,
    "probe": 8,
    "bench": 8,
    "": 8,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported_names(module: str, path: Path) -> Iterator[str]:
    """Every absolute module name ``module`` imports (``from a import b`` yields ``a`` and ``a.b``)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        graph[module] = {name for name in _imported_names(module, path) if name in MODULES and name != module}
    return graph


GRAPH = _graph()


def _external(module: str) -> set[str]:
    """Top-level names of the third-party packages ``module`` imports itself."""
    return {name.split(".")[0] for name in _imported_names(module, MODULES[module])} - {PACKAGE}


def _reachable(start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for name in GRAPH[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_the_package() -> None:
    # Guards the parser: a graph without the known edges would make every other test pass vacuously.
    assert "clef_runtime.engine.clef" in GRAPH
    assert "clef_runtime.model.backbone" in GRAPH["clef_runtime.engine.clef"]
    assert "clef_runtime.protocol.systemone" in GRAPH["clef_runtime.server.routes.systemone"]
    # A function-level import is an edge too.
    assert "clef_runtime.engine.clef" in GRAPH["clef_runtime.server.runtime"]


def test_no_import_cycles() -> None:
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    looped = {name: set(edges) for name, edges in GRAPH.items()}
    looped["clef_runtime.protocol.errors"].add("clef_runtime.engine.clef")
    cycle = _find_cycle(looped)
    assert cycle is not None and cycle[0] == cycle[-1]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module: str) -> None:
    rank = RANKS[_layer(module)]
    upward = sorted(name for name in GRAPH[module] if RANKS[_layer(name)] > rank)
    assert not upward, f"{module} (layer {_layer(module) or 'root'}) imports a higher layer: {upward}"


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, n) for m, edges in graph.items() for n in edges if RANKS[_layer(n)] > RANKS[_layer(m)])


def test_the_server_and_the_cli_do_not_import_each_other_backwards() -> None:
    server = [name for name in MODULES if _layer(name) == "server"]
    assert not [
        (m, n) for m in server for n in GRAPH[m] if _layer(n) in ("cli", "serve_command", "bench", "")
    ]


def test_the_server_never_imports_the_scale_out() -> None:
    assert RANKS["server"] < RANKS["scale"] < RANKS["serve_command"]
    assert "clef_runtime.server.runtime" in GRAPH["clef_runtime.scale.ray_serve"]  # scale builds on server
    assert not [
        (m, n) for m, edges in GRAPH.items() if _layer(m) == "server" for n in edges if _layer(n) == "scale"
    ]
    # The layer check itself refuses such an import.
    wrong = {name: set(edges) for name, edges in GRAPH.items()}
    wrong["clef_runtime.server.app"].add("clef_runtime.scale.ray_serve")
    assert ("clef_runtime.server.app", "clef_runtime.scale.ray_serve") in _upward(wrong)
    assert not _upward(GRAPH)


def test_only_the_cli_imports_tuning() -> None:
    # Tuning sits beside evaluation (it reads model, engine, evaluation and protocol); nothing but the CLI may
    # depend on it, evaluation included.
    importers = {
        m for m, edges in GRAPH.items() for n in edges if _layer(n) == "tuning" and _layer(m) != "tuning"
    }
    assert importers == {"clef_runtime.cli"}


# Inside server/: a flat HTTP core (the modules directly in server/) below feature packages (its folders).
# app.py assembles the features (the composition root): the only core module that may name one.
SERVER = "clef_runtime.server"
SERVER_ASSEMBLY = "clef_runtime.server.app"
# MCP's classifier tools (classify_<name>) decide through the saved classifiers: the one feature that
# reaches into another.
FEATURE_EXCEPTIONS = {("mcp", "classifiers")}


def _server_feature(module: str) -> str | None:
    """The feature package of a server module (``routes``, ``openai``, ...), or None for the core."""
    parts = module.split(".")
    if parts[:2] != ["clef_runtime", "server"] or len(parts) < 4:
        return None
    return parts[2] if (ROOT / "server" / parts[2]).is_dir() else None


def _server_rule_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    breaks = []
    for module, edges in graph.items():
        if not module.startswith(SERVER + ".") and module != SERVER:
            continue
        own = _server_feature(module)
        for name in edges:
            other = _server_feature(name)
            if other is None or other == own:
                continue
            if own is None and module != SERVER_ASSEMBLY:
                breaks.append((module, name))  # the core names a feature
            elif own is not None and (own, other) not in FEATURE_EXCEPTIONS:
                breaks.append((module, name))  # a feature names another
    return sorted(breaks)


def test_server_features_are_packages_over_a_flat_core() -> None:
    features = {feature for name in MODULES if (feature := _server_feature(name)) is not None}
    assert features == {"routes", "openai", "mcp", "classifiers", "jobs", "pages"}
    # The scan sees the assembly and a feature's use of the core.
    assert "clef_runtime.server.routes.systemone" in GRAPH[SERVER_ASSEMBLY]
    assert "clef_runtime.server.flow" in GRAPH["clef_runtime.server.routes.systemone"]


def test_the_server_core_never_imports_a_feature_and_features_not_each_other() -> None:
    assert not _server_rule_breaks(GRAPH)


def test_the_server_rule_refuses_a_core_or_cross_feature_import() -> None:
    wrong = {name: set(edges) for name, edges in GRAPH.items()}
    wrong["clef_runtime.server.flow"].add("clef_runtime.server.openai.chat")
    wrong["clef_runtime.server.jobs.routes"].add("clef_runtime.server.pages.routes")
    assert _server_rule_breaks(wrong) == [
        ("clef_runtime.server.flow", "clef_runtime.server.openai.chat"),
        ("clef_runtime.server.jobs.routes", "clef_runtime.server.pages.routes"),
    ]


def test_every_module_has_a_layer() -> None:
    assert not [name for name in MODULES if _layer(name) not in RANKS]


def test_the_protocol_never_reaches_torch() -> None:
    for start in [name for name in MODULES if _layer(name) == "protocol"]:
        for module in _reachable(start):
            heavy = _external(module) & {"torch", "transformers", "safetensors", "numpy"}
            assert not heavy, f"{start} reaches {module}, which imports {sorted(heavy)}"


def test_the_engine_never_reaches_http() -> None:
    for start in [name for name in MODULES if _layer(name) in ("engine", "model", "vision", "encoding")]:
        for module in _reachable(start):
            http = _external(module) & {"fastapi", "starlette", "uvicorn", "httpx"}
            assert not http, f"{start} reaches {module}, which imports {sorted(http)}"
