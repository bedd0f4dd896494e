"""Traced forward graphs on disk (``gpu.model.graph_cache``): a process that finds a
graph of the same model, shapes and code loads it instead of tracing, with outputs
identical to a fresh trace; a corrupt, foreign or wrong entry is ignored and traced
again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, prompt_of

from gpu.engine import ModelEngine
from gpu.model import capture, graph_cache
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions


def _run(model_dir: Path) -> tuple[list[object], capture.ForwardCapture]:
    """A fresh process's view (no graph in memory): a prefill and decodes at two batch
    sizes; returns the tokens and the decoder's capture."""
    capture._shared_graphs.clear()
    engine = ModelEngine.load(model_dir, device="cpu", dtype=None, catalog=CATALOG,
                              page_size=PAGE_SIZE, num_pages=32, state_rows=4,
                              execution=ExecutionOptions.eager(capture_forward=True))
    driver = ReferenceDriver(engine)
    out: list[object] = [driver.prefill(PREFILL_64, 0, prompt_of(30, seed=1), chunk=64),
                         driver.prefill(PREFILL_64, 1, prompt_of(7, seed=2), chunk=64)]
    for _ in range(3):
        out.append(driver.decode(DECODE[1], [0]))
        out.append(driver.decode(DECODE[2], [1, 0]))
    graphs = engine.parts.decoder.capture
    assert graphs is not None
    return out, graphs


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLARE_GRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(capture, "_shared_graphs", {})
    return tmp_path


def test_a_new_process_loads_the_graphs_instead_of_tracing(
        cache_dir: Path, tiny_checkpoints: dict[str, Path]) -> None:
    first, traced = _run(tiny_checkpoints["llama"])
    # a forward and two whole-step graphs (greedy and sampled frames) per program
    assert (traced.traced, traced.loaded) == (9, 0)
    assert len(list(cache_dir.glob("*.pt"))) == 9
    again, loaded = _run(tiny_checkpoints["llama"])
    assert (loaded.traced, loaded.loaded) == (0, 9)
    assert again == first


def test_corrupt_foreign_and_wrong_entries_are_ignored_and_traced_again(
        cache_dir: Path, tiny_checkpoints: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    first, _ = _run(tiny_checkpoints["llama"])
    files = sorted(cache_dir.glob("*.pt"))
    # corrupt: every file truncated; the next process traces and rewrites them
    for path in files:
        path.write_bytes(path.read_bytes()[:100])
    out, graphs = _run(tiny_checkpoints["llama"])
    assert (graphs.traced, graphs.loaded, out) == (9, 0, first)
    # foreign: each file holds another shape's graph under its name
    contents = [path.read_bytes() for path in files]
    for path, other in zip(files, contents[1:] + contents[:1], strict=True):
        path.write_bytes(other)
    out, graphs = _run(tiny_checkpoints["llama"])
    assert (graphs.traced, graphs.loaded, out) == (9, 0, first)
    # wrong: a graph saved under the right key whose replay differs from the forward
    real_load = graph_cache.GraphCache.load

    def wrong(self: graph_cache.GraphCache, key: tuple[object, ...]) -> Any:
        graph = real_load(self, key)
        assert graph is not None

        def replay(*args: torch.Tensor) -> Any:
            out = graph(*args)  # a forward's hidden states, or a step's outputs
            return tuple(t + 1 for t in out) if isinstance(out, tuple) else out + 1.0
        return replay

    monkeypatch.setattr(graph_cache.GraphCache, "load", wrong)
    out, graphs = _run(tiny_checkpoints["llama"])
    assert (graphs.traced, graphs.loaded, out) == (9, 0, first)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace
def test_other_code_names_other_files(cache_dir: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    def double(a: torch.Tensor) -> torch.Tensor:
        return a * 2

    cache = graph_cache.GraphCache(cache_dir)
    key = ("shape", 4)
    assert cache.save(key, torch.jit.trace(double, (torch.ones(2),)))  # type: ignore[no-untyped-call]
    graph = cache.load(key)
    assert graph is not None and torch.equal(graph(torch.ones(3)), torch.full((3,), 2.0))
    assert cache.load(("shape", 5)) is None
    monkeypatch.setattr(graph_cache, "code_digest", lambda: "edited")
    assert cache.load(key) is None


def test_the_cache_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("FLARE_GRAPH_CACHE", "off")
    assert graph_cache.graph_cache_dir() is None
    monkeypatch.delenv("FLARE_GRAPH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graph_cache.graph_cache_dir() == tmp_path / "flare" / "graphs"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace
def test_an_unwritable_directory_only_skips_the_cache(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = graph_cache.GraphCache(blocker / "graphs")
    graph = torch.jit.trace(lambda a: a + 1, (torch.ones(2),))  # type: ignore[no-untyped-call]
    assert cache.save(("shape",), graph) is False
    assert cache.load(("shape",)) is None
