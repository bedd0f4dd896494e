"""``flare bench programs`` on the cpu backend with a tiny real checkpoint.

Covers: the bench builds the catalog from flags (SPEC-10, CAT-12), prepares exactly it
on the backend (MIX-39, MIX-48), launches every shape with a full frame through the
engine's real programs, and reports a median device time and tokens per second per
shape, as a table and as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.cli import main as flare


@pytest.mark.slow
def test_bench_programs_times_every_catalog_shape(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "bench.json"
    code = flare([
        "bench", "programs", "--model", str(tiny_checkpoints["llama"]), "--max-batch", "2",
        "--prefill-capacity", "64", "--mixed-prefill", "--context", "20", "--warmup", "0",
        "--repeats", "1", "--threads", "1", "--json", str(out),
    ])
    assert code == 0
    payload = json.loads(out.read_text())
    labels = [r["shape"] for r in payload["results"]]
    assert labels == payload["plan"]["shapes"]
    assert sorted(labels) == sorted(s["label"] for s in payload["preparation"]["shapes"])
    assert {"decode[B=1]", "decode[B=2]", "prefill[C=64]", "scored_prefill[C=64]",
            "mixed[B=2,W=1,C=64]", "state.snapshot[B=1]"} <= set(labels)
    by_label = {r["shape"]: r for r in payload["results"]}
    assert by_label["prefill[C=64]"]["tokens"] == 64
    assert by_label["mixed[B=2,W=1,C=64]"]["tokens"] == 65
    for r in payload["results"]:
        assert r["median_device_ms"] > 0
        assert r["median_wall_ms"] >= r["median_device_ms"]
        assert (r["tokens_per_second"] is None) == (r["tokens"] == 0)
    assert payload["execution"] == "eager" and payload["torch_threads"] == 1
    table = capsys.readouterr().out
    assert "tokens/s" in table and "decode[B=2]" in table
    assert "execution: eager" in table


def test_bench_programs_static_context_runs_the_capturable_programs(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--static-context`` times the full max-context programs CUDA captures."""
    out = tmp_path / "bench.json"
    code = flare([
        "bench", "programs", "--model", str(tiny_checkpoints["llama"]), "--max-batch", "1",
        "--prefill-capacity", "64", "--context", "20", "--max-context", "128",
        "--warmup", "0", "--repeats", "1", "--threads", "1", "--static-context",
        "--json", str(out),
    ])
    assert code == 0
    assert json.loads(out.read_text())["execution"] == "static"
    assert "execution: static" in capsys.readouterr().out


def test_bench_programs_without_a_checkpoint(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert flare(["bench", "programs", "--model", str(tmp_path)]) == 2
    assert "config.json missing" in capsys.readouterr().err


def test_bench_programs_on_cuda_without_a_device(
    tiny_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str],
) -> None:
    """Selecting cuda without a GPU stops with the probe's reason, no traceback."""
    from gpu.backends.cuda_probe import probe_cuda

    if probe_cuda().available:
        pytest.skip("a CUDA device is present")
    code = flare(["bench", "programs", "--backend", "cuda",
                  "--model", str(tiny_checkpoints["llama"])])
    assert code == 2
    assert "cuda: no CUDA device (" in capsys.readouterr().err
