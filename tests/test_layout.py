"""Import-graph rules from docs/architecture.md: arrows point one way."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "policy": {"trio", "torch", "time", "datetime", "asyncio", "gpu", "actors", "app", "ops",
               "cuda", "structlog", "random"},
    "gpu": {"trio", "actors", "app", "ops"},
    "actors": {"app", "ops"},
    "app": {"ops"},
}


def imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_cat_5_cat_7_import_arrows(package: str) -> None:
    """Covers CAT-5 (policy imports no trio/torch/clock), CAT-7 (nothing imports ops)."""
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_roots(path) & FORBIDDEN[package]
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


# --------------------------------------------------------------------------- arrows
# The import graph over flare's own modules: which module imports which, resolved to
# the deepest module that exists (``from gpu.frames import FRAME_KEY`` is an edge to
# ``gpu.frames``, ``from actors import Runtime`` one to the ``actors`` face).

PRODUCTION = ("app", "actors", "gpu", "policy", "ops")
MAX_PRODUCTION_LINES = 500


def _arrows_module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _arrows_modules() -> dict[str, pathlib.Path]:
    """Every production module by dotted name."""
    return {_arrows_module_name(path): path
            for package in PRODUCTION for path in sorted((ROOT / package).rglob("*.py"))}


MODULES = _arrows_modules()


def _arrows_statements(tree: ast.Module, *, module_level: bool) -> list[ast.stmt]:
    """The import statements of a module: all of them, or (``module_level``) only those
    that run when it is imported (not in functions, classes or ``if TYPE_CHECKING``)."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def _arrows_resolve(name: str) -> str | None:
    """The deepest production module ``name`` lies in (None: not flare's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _arrows_imports(module: str, *, module_level: bool = False) -> set[str]:
    """The production modules ``module`` imports."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _arrows_statements(tree, module_level=module_level):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        targets.update(t for t in map(_arrows_resolve, names) if t is not None)
    targets.discard(module)
    return targets


def _arrows_graph(*, module_level: bool = False) -> dict[str, set[str]]:
    return {m: _arrows_imports(m, module_level=module_level) for m in MODULES}


def _arrows_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_arrows_gpu_imports_only_policy_descriptors() -> None:
    """gpu reads policy's descriptor types and nothing else of policy (any import,
    also inside functions and under ``TYPE_CHECKING``)."""
    offenders = {m: sorted(t for t in targets if t.split(".")[0] == "policy"
                           and t != "policy.descriptors")
                 for m, targets in _arrows_graph().items() if m.split(".")[0] == "gpu"}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_arrows_app_imports_only_the_actors_face() -> None:
    """app's only flare import is the ``actors`` package face (``actors/__init__.py``)."""
    offenders = {m: sorted(t for t in targets if t.split(".")[0] != "app" and t != "actors")
                 for m, targets in _arrows_graph().items() if m.split(".")[0] == "app"}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_arrows_nothing_outside_ops_and_tests_imports_ops() -> None:
    """Every Python file of the repository outside ``ops/`` and ``tests/`` (production
    packages and any other script) leaves ``ops`` alone."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("ops", "tests") or any(p.startswith(".") for p in rel.parts):
            continue
        if "ops" in imported_roots(path):
            offenders.append(str(rel))
    assert offenders == []


def test_arrows_no_import_cycles() -> None:
    """The module-level imports of the production modules form no cycle (within gpu,
    within each package, or across them); imports inside functions or under
    ``TYPE_CHECKING`` do not count."""
    assert _arrows_cycles(_arrows_graph(module_level=True)) == []


def _arrows_entry_points() -> set[str]:
    """Modules that run without a production importer: package faces, the console
    scripts of ``pyproject.toml`` and the commands ``ops.cli`` imports by name."""
    import tomllib

    from ops.cli import COMMANDS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts = {target.split(":")[0] for target in project.get("scripts", {}).values()}
    faces = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    return faces | scripts | {module for _, module, _ in COMMANDS}


def test_arrows_every_production_module_has_a_production_importer() -> None:
    """No production module is there only for the tests: each is imported by another
    production module or is an entry point."""
    imported = set().union(*_arrows_graph().values())
    orphans = sorted(set(MODULES) - imported - _arrows_entry_points())
    assert orphans == []


def test_arrows_no_production_file_over_500_lines() -> None:
    """Production files stay small enough to read whole: at most 500 lines each."""
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_PRODUCTION_LINES}
    assert long == {}
