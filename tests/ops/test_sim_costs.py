"""Cost tables for the simulator: the synthetic model and ``flare bench programs`` JSON.

Covers the simulator's cost tables: the documented ``a + b * size`` formulas,
loading measured medians by shape label (device time, wall time as the fallback),
refusing a file that misses catalog shapes, and mean-preserving seeded noise.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from gpu.catalog import CatalogFlags, build_catalog
from ops.sim.costs import CostTableError, SyntheticCosts, load_bench_programs
from policy.descriptors import GraphKind, GraphShape, StateOp, TargetBinding

MS = 1_000_000


def test_synthetic_formulas() -> None:
    costs = SyntheticCosts()
    prefill = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=1024)
    decode = GraphShape(kind=GraphKind.DECODE, batch_capacity=8, token_capacity=1,
                        packed_capacity=8)
    mixed = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=1,
                       prefill_capacity=256, packed_capacity=259)
    snap = GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0,
                      state_op=StateOp.SNAPSHOT)
    assert costs.mean_ms(prefill) == pytest.approx(3.0 + 0.02 * 1024)
    assert costs.mean_ms(decode) == pytest.approx(8.0 + 0.05 * 8)
    assert costs.mean_ms(mixed) == pytest.approx(8.0 + 0.05 * 4 + 0.9 * 0.02 * 256)
    assert costs.mean_ms(snap) == pytest.approx(1.2)
    # the target verifies P = 16 rows in one pass; the draft runs D = 3 sequential steps
    round_ = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=4,
                        proposal_depth=3, packed_capacity=16,
                        binding=TargetBinding.QUERY_LENGTH)
    assert costs.mean_ms(round_) == pytest.approx(8.0 + 0.05 * 16 + 0.8 * 3)
    # a wider speculative mixed program pays its D = W - 1 draft steps too
    wide = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=3,
                      proposal_depth=2, prefill_capacity=256, packed_capacity=265,
                      speculation_enabled=True)
    assert costs.mean_ms(wide) == pytest.approx(
        8.0 + 0.05 * 12 + 0.9 * 0.02 * 256 + 0.8 * 2)
    table = costs.table([prefill, decode])
    assert table.mean_ns[prefill] == round((3.0 + 0.02 * 1024) * MS)
    assert table.source == "synthetic"


def _bench_file(tmp_path: pathlib.Path, shapes: tuple[GraphShape, ...],
                skip: int = 0) -> pathlib.Path:
    results = []
    for i, s in enumerate(shapes[skip:]):
        device = 0.0 if i == 0 else 1.0 + i
        results.append({"shape": s.label(), "kind": s.kind.value, "tokens": 1,
                        "median_device_ms": device, "median_wall_ms": 50.0, "runs": 3})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"model": "m", "backend": "cpu", "results": results}))
    return path


def test_load_bench_programs_maps_labels_to_the_catalog(tmp_path: pathlib.Path) -> None:
    shapes = build_catalog(CatalogFlags(max_batch=4)).shapes
    table = load_bench_programs(_bench_file(tmp_path, shapes), shapes)
    assert table.mean_ns[shapes[0]] == 50 * MS  # no device interval: the wall median
    assert table.mean_ns[shapes[3]] == 4 * MS
    assert set(table.mean_ns) == set(shapes)


def test_load_bench_programs_refuses_missing_shapes(tmp_path: pathlib.Path) -> None:
    shapes = build_catalog(CatalogFlags(max_batch=4)).shapes
    with pytest.raises(CostTableError, match="no timing for 2 catalog shapes"):
        load_bench_programs(_bench_file(tmp_path, shapes, skip=2), shapes)
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(CostTableError, match="results"):
        load_bench_programs(bad, shapes)


def test_noise_is_seeded_and_mean_preserving() -> None:
    shape = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                       packed_capacity=1)
    table = SyntheticCosts().table([shape])
    mean = table.mean_ns[shape]
    assert table.duration_ns(shape, np.random.default_rng(0), 0.0) == mean

    def draws(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [table.duration_ns(shape, rng, 0.3) for _ in range(4000)]

    assert draws(1) == draws(1) != draws(2)
    assert np.mean(draws(1)) == pytest.approx(mean, rel=0.03)
    assert min(draws(1)) < mean < max(draws(1))
