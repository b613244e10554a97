"""The floors, checked from the imports: schemas/ and common/ import nothing above them, no
service imports another, and the decision floor (common/decide) imports no I/O of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function-local imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("floor", ["common", "schemas"])
def test_the_lower_floors_import_nothing_above_them(floor):
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m.split(".")[0] in ("services", "tools"))
           for p in modules(floor)}
    assert not {k: v for k, v in bad.items() if v}


# a service that is the sum of others may import them: a coupled instance runs a prefill and a
# decode service in one process, on one model
COMPOSED_OF = {"coupled": {"prefill", "decode"}}


def test_no_service_imports_another_but_the_coupled_one_its_two_halves():
    bad = {}
    for path in modules("services"):
        own = path.relative_to(ROOT / "services").parts[0]
        allowed = {own} | COMPOSED_OF.get(own, set())
        other = sorted(m for m in imports(path) if m.startswith("services.") and m.split(".")[1] not in allowed)
        if other:
            bad[str(path.relative_to(ROOT))] = other
    assert not bad
    used = {m.split(".")[1] for p in modules("services/coupled") for m in imports(p) if m.startswith("services.")}
    assert used - {"coupled"} == COMPOSED_OF["coupled"]  # it is their sum, and says so


def test_the_decision_floor_is_pure():
    # decisions take a snapshot and return a verdict: no clock, no files, no sockets, no bus
    impure = {"time", "os", "pathlib", "socket", "asyncio", "nats", "aiohttp", "torch", "lmdb", "json"}
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m.split(".")[0] in impure)
           for p in modules("common/decide")}
    assert not {k: v for k, v in bad.items() if v}
    inside = {m for p in modules("common/decide") for m in imports(p) if m.startswith("common.")}
    assert all(m.startswith(("common.decide", "common.kv.blocks")) for m in inside), inside


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in `graph` (module -> modules it imports), [] if there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for other in sorted(graph.get(module, ())):
            found = visit(other, path + [module])
            if found:
                return found
        done.add(module)
        return []

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), [])


@pytest.mark.parametrize("package", sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()))
def test_a_service_s_modules_import_in_a_line(package):
    # function-local imports count: a circle broken only by one is still a circle
    names = {f"services.{package}.{p.stem}": p for p in modules(f"services/{package}") if p.parent.name == package}
    graph = {name: {m for m in imports(path) if m in names and m != name} for name, path in names.items()}
    assert _circle(graph) == []


def test_every_module_imports():
    """A module moved without its importers noticed (tools/experiments imported `tools.moonbus.replay`
    for weeks after replay moved under traces/) fails here, not in a user's hands."""
    import importlib
    import pkgutil

    import common
    import schemas
    import services
    import tools

    broken = {}
    for package in (common, schemas, services, tools):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module.name.endswith("__main__"):
                continue  # running it is what `python -m` does
            try:
                importlib.import_module(module.name)
            except Exception as exc:
                broken[module.name] = repr(exc)
    assert not broken, broken
