"""The README's "Testing your application against flare" examples run as they stand:
each of its Python blocks becomes a test file of a fresh pytest run (``pytester``) in
which flare's plugin is loaded as its entry point loads it, and every test passes."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import openai  # noqa: F401
import pytest

import ops.testing  # noqa: F401
from actors import system  # noqa: F401

# The inner run is in process and pytester drops the modules it imported when it ends;
# torch, the runtime and openai are imported here first, so they stay loaded.

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTION = "## Testing your application against flare"


def readme_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def plugin_arguments() -> list[str]:
    """``-p ops.pytest_plugin`` unless the installed flare registers its entry point
    (then pytest has loaded it already and a second registration would fail)."""
    installed = {ep.name for ep in importlib.metadata.entry_points(group="pytest11")}
    return [] if "flare" in installed else ["-p", "ops.pytest_plugin"]


def test_the_section_has_a_server_and_a_runtime_example() -> None:
    examples = readme_examples()
    assert len(examples) == 2
    assert "flare_server" in examples[0] and "flare_runtime" in examples[1]
    assert all(len(code.strip().splitlines()) <= 14 for code in examples)


def test_readme_examples_pass_as_a_users_suite(pytester: pytest.Pytester) -> None:
    examples = readme_examples()
    for number, code in enumerate(examples):
        pytester.makepyfile(**{f"test_example_{number}": code})
    # In process, the plugin module is imported already and cannot be assertion-rewritten.
    result = pytester.runpytest_inprocess(
        *plugin_arguments(), "-q", "-p", "no:cacheprovider", "-W", "error",
        "-W", "ignore::pytest.PytestAssertRewriteWarning")
    result.assert_outcomes(passed=len(examples))
