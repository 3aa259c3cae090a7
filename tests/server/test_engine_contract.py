"""The server's engine contract: the real engine, the Ray Serve ingress's engine and the fake one all have
every member of `DecisionEngine`, with the contract's parameters; the server uses nothing else of an
engine, and never looks an engine's member up by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
from devtools.fake_engine import FakeClef

import clef_runtime.server as server_package
from clef_runtime.engine.card import CardedEngine
from clef_runtime.engine.clef import Clef
from clef_runtime.engine.contract import DecisionEngine
from clef_runtime.scale.ray_serve import IngressEngine

METHODS = [
    "prepare",
    "head_infos",
    "load_head",
    "unload_head",
    "runner",
    "warmup",
    "cache_stats",
    "replica_status",
    "prepare_compute_thread",
]
ATTRIBUTES = ["card"]
#: Read from the card (`clef_runtime.engine.card.CardedEngine`).
PROPERTIES = ["name", "step_tokens"]
ENGINES = [Clef, IngressEngine, FakeClef]


def _parameters(function: Any) -> list[tuple[str, Any, bool]]:
    """(name, kind, has a default) of every parameter but ``self``."""
    return [
        (p.name, p.kind, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(function).parameters.values()
        if p.name != "self"
    ]


def test_the_contract_lists_what_the_test_checks() -> None:
    declared = {name for name in vars(DecisionEngine) if not name.startswith("_")}
    assert declared == set(METHODS) | set(PROPERTIES)
    assert set(DecisionEngine.__annotations__) == set(ATTRIBUTES)


@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda engine: engine.__name__)
def test_every_engine_reads_the_properties_from_its_card(engine_class: type) -> None:
    for name in PROPERTIES:
        assert getattr(engine_class, name) is getattr(CardedEngine, name), name


@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda engine: engine.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_methods_match_the_contract(engine_class: type, method: str) -> None:
    implementation = getattr(engine_class, method, None)
    assert callable(implementation), f"{engine_class.__name__} has no {method}()"
    assert _parameters(implementation) == _parameters(getattr(DecisionEngine, method))


def test_the_fake_engine_has_every_attribute() -> None:
    engine = FakeClef(name="fake-x")
    for name in ATTRIBUTES + PROPERTIES:
        assert hasattr(engine, name), name
    assert engine.name == engine.card.model.name == "fake-x"


@pytest.mark.parametrize("engine_class", [Clef, IngressEngine], ids=lambda engine: engine.__name__)
def test_the_real_engines_set_every_attribute(engine_class: type) -> None:
    # Read from __init__'s source (``self.<name> = ...``), without loading a model or starting Ray.
    tree = ast.parse(inspect.getsource(engine_class.__init__).strip())
    assigned = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    assert set(ATTRIBUTES) <= assigned, set(ATTRIBUTES) - assigned


def _engine_members_used_by_the_server() -> set[str]:
    """Attribute names read on any variable called ``engine`` (or ``self._engine``) in server/."""
    used: set[str] = set()
    for path in Path(server_package.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                target = node.value
                if (isinstance(target, ast.Name) and target.id == "engine") or (
                    isinstance(target, ast.Attribute) and target.attr == "_engine"
                ):
                    used.add(node.attr)
    return used


def test_the_server_uses_only_the_contract() -> None:
    used = _engine_members_used_by_the_server()
    assert "runner" in used  # the scan sees the server's calls
    contract = set(METHODS) | set(ATTRIBUTES) | set(PROPERTIES)
    assert used <= contract, used - contract


def _dynamic_lookups_in_the_server() -> list[str]:
    """``getattr`` / ``hasattr`` calls in server/ on an engine (an object whose expression names one), as
    ``file:line``."""
    found = []
    for path in sorted(Path(server_package.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and "engine" in ast.unparse(node.args[0]).lower()
            ):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_server_never_looks_an_engine_member_up_by_name() -> None:
    assert not _dynamic_lookups_in_the_server()


def test_the_lookup_scan_sees_a_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "routes.py").write_text("def f(engine):\n    return getattr(engine, 'backbone', None)\n")
    monkeypatch.setattr(server_package, "__file__", str(tmp_path / "__init__.py"))
    assert _dynamic_lookups_in_the_server() == ["routes.py:2"]


def test_the_engine_thread_prepares_itself_for_compute(serve_fake: Any) -> None:
    # The thread that runs every engine step is the one that starts the CPU thread team (model/kernels.py).
    served = serve_fake()
    response = served.client.post("/v1/systemone", json={"state": "x", "questions": {"q": {"type": "noul"}}})
    assert response.status_code == 200
    assert served.engine.compute_thread == "clef-engine"
