"""Shared test configuration: the ``cuda`` marker skips cleanly without a device, and
flare's own pytest plugin (``ops.pytest_plugin``) is loaded where flare is not installed
with its entry point (a checkout on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Traced forward graphs (``gpu.model.graph_cache``) are kept for this session only:
# every device process a test starts reuses what an earlier one traced.
_GRAPHS = None
if "FLARE_GRAPH_CACHE" not in os.environ:
    _GRAPHS = os.environ["FLARE_GRAPH_CACHE"] = tempfile.mkdtemp(prefix="flare-graphs-")

pytest_plugins = ("pytester",)  # runs the README's example as a user's test suite


def pytest_configure(config: pytest.Config) -> None:
    manager = config.pluginmanager
    if not manager.has_plugin("flare") and not manager.is_blocked("flare"):
        import ops.pytest_plugin

        manager.register(ops.pytest_plugin, "flare")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GRAPHS is not None:
        shutil.rmtree(_GRAPHS, ignore_errors=True)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
