"""Shipped code imports only shipped dependencies: no package module imports a
distribution of ``pyproject.toml``'s ``dev`` extra (test, lint and reference tools), at
module level or inside a function."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = ("app", "actors", "gpu", "ops", "policy")
IMPORT_NAMES = {"pytest-trio": "pytest_trio"}
"""Distributions whose import name is not the distribution name."""


def dev_imports() -> set[str]:
    """The top-level import names of the ``dev`` extra's distributions."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["optional-dependencies"]["dev"]:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match, requirement
        dist = match.group(0).lower()
        names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_").replace(".", "_")))
    return names


def imported_roots(path: pathlib.Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_dev_extra_is_read() -> None:
    assert {"pytest", "pytest_trio", "hypothesis", "transformers", "openai", "ruff",
            "mypy"} <= dev_imports()


@pytest.mark.parametrize("package", SHIPPED)
def test_shipped_code_imports_no_dev_dependency(package: str) -> None:
    dev = dev_imports()
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_roots(path) & dev
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}
