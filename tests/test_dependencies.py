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


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extra_imports(extra: str) -> set[str]:
    """The top-level import names of an extra's distributions."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match, requirement
        dist = match.group(0).lower()
        names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_").replace(".", "_")))
    return names


def dev_imports() -> set[str]:
    """The top-level import names of the ``dev`` extra's distributions."""
    return extra_imports("dev")


def pytest_plugin_paths() -> set[pathlib.Path]:
    """The files of the modules pytest loads through flare's ``pytest11`` entry points."""
    targets = PROJECT.get("entry-points", {}).get("pytest11", {}).values()
    return {ROOT / (target.split(":")[0].replace(".", "/") + ".py") for target in targets}


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
    """The one exception: a module registered as a ``pytest11`` entry point (only pytest
    loads it) may import what the ``testing`` extra installs, and nothing else of dev."""
    dev = dev_imports()
    plugins = pytest_plugin_paths()
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        allowed = extra_imports("testing") if path in plugins else set()
        bad = imported_roots(path) & dev - allowed
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_the_pytest_plugin_is_loaded_only_by_pytest() -> None:
    """No shipped module imports the plugin module (serving never needs pytest), the
    plugin exists, and the ``testing`` extra pins what ``dev`` pins."""
    plugins = pytest_plugin_paths()
    assert plugins and all(path.is_file() for path in plugins)
    names = {str(path.relative_to(ROOT).with_suffix("")).replace("/", ".") for path in plugins}
    importers = {str(path.relative_to(ROOT)) for package in SHIPPED
                 for path in (ROOT / package).rglob("*.py")
                 if any(f"import {name}" in path.read_text() or f"from {name} import"
                        in path.read_text() for name in names)}
    assert importers == set()
    testing = set(PROJECT["optional-dependencies"]["testing"])
    assert testing <= set(PROJECT["optional-dependencies"]["dev"])
