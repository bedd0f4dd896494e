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
