"""flare's pytest fixtures, registered with pytest through the ``pytest11`` entry point
``flare`` (``pyproject.toml``), so a project that installs ``flare[testing]`` has them
in every test without an import. They are trio fixtures: the tests that use them run
under pytest-trio (``trio_mode = true``, or ``@pytest.mark.trio`` on each test).

- ``flare_runtime``: ``open_runtime`` on the embedded default model with
  ``flare_runtime_config`` (default ``ops.testing.quick_config()``), one per test.
- ``flare_server``: that runtime's HTTP app on a free loopback port with
  ``flare_app_settings`` (default ``AppSettings()``); an ``ops.testing.FlareServer``
  whose ``url`` suits httpx and whose ``base_url`` suits ``openai.AsyncOpenAI``.

Override ``flare_runtime_config`` or ``flare_app_settings`` in a ``conftest.py`` to serve
another model or to set an API key. Only pytest loads this module; nothing in flare
imports it, so serving never needs pytest (``tests/test_dependencies.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from actors import Runtime
    from actors.config import RuntimeConfig
    from app import AppSettings
    from ops.testing import FlareServer

# flare itself (torch, the model) is imported when a test first asks for a fixture, not
# when pytest loads its plugins: suites that never use them start as fast as before.


@pytest.fixture
def flare_runtime_config() -> RuntimeConfig:
    """The configuration ``flare_runtime`` opens; override it to change the model."""
    from ops.testing import quick_config

    return quick_config()


@pytest.fixture
def flare_app_settings() -> AppSettings:
    """The settings ``flare_server`` serves with."""
    from app import AppSettings

    return AppSettings()


@pytest.fixture
async def flare_runtime(flare_runtime_config: RuntimeConfig) -> AsyncIterator[Runtime]:
    """A running runtime for one test, shut down after it."""
    from ops.testing import open_test_runtime

    async with open_test_runtime(flare_runtime_config) as runtime:
        yield runtime


@pytest.fixture
async def flare_server(flare_runtime: Runtime,
                       flare_app_settings: AppSettings) -> AsyncIterator[FlareServer]:
    """``flare_runtime`` served over HTTP on ``127.0.0.1`` and a free port."""
    from ops.testing import open_test_server

    async with open_test_server(flare_runtime, flare_app_settings) as server:
        yield server
