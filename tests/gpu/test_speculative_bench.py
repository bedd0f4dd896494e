"""``flare bench programs --speculation draft|copy``: complete speculative rounds timed
beside decode on the cpu backend with a tiny real checkpoint.

Covers: a speculative load's catalog (SPEC-2, SPEC-12; with ``--speculative-allocation
device`` the ragged device-allocated programs, SPEC-13, SPEC-22) is prepared and every
shape is launched with a full frame (complete rounds: CAT-10); the side-by-side table
and the JSON give, per request bucket, the plain decode step, the draft-maintaining
decode step and every round with its ratio to the plain step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.cli import main as flare


@pytest.mark.parametrize(("source", "extra"), [
    ("copy", ["--speculative-allocation", "device"]),
    ("draft", ["--sampled"]),
])
def test_bench_programs_prints_rounds_beside_decode(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    source: str, extra: list[str],
) -> None:
    model = tiny_checkpoints["llama"]
    out = tmp_path / "bench.json"
    code = flare([
        "bench", "programs", "--model", str(model), "--max-batch", "2",
        "--prefill-capacity", "64", "--context", "20", "--warmup", "0", "--repeats", "1",
        "--threads", "1", "--speculation", source, "--draft-model", str(model),
        "--draft-depth", "2", "--json", str(out), *extra,
    ])
    assert code == 0
    payload = json.loads(out.read_text())
    labels = [r["shape"] for r in payload["results"]]
    assert labels == payload["plan"]["shapes"]  # every catalog shape, each once
    by_label = {r["shape"]: r for r in payload["results"]}
    buckets = payload["speculation"]["buckets"]
    assert [b["batch"] for b in buckets] == [1, 2]
    assert payload["speculation"]["sampled"] == ("--sampled" in extra)
    for bucket in buckets:
        b = bucket["batch"]
        widths = [r["width"] for r in bucket["rounds"] if r["binding"] == "QueryLength"]
        assert widths == [1, 2, 3]
        for r in bucket["rounds"]:
            assert by_label[r["shape"]]["median_cpu_ms"] == pytest.approx(r["ms"],
                                                                             abs=1e-4)
            assert r["ratio"] == pytest.approx(r["ms"] / bucket["decode_ms"], rel=1e-2)
        device = [r for r in bucket["rounds"] if r["binding"] == "SpeculativePrefixLimit"]
        if source == "copy" and b == 2:
            assert [(r["width"], r["rows"]) for r in device] == [(2, 3), (3, 4)]
        else:
            assert not device
    # a full-width round verifies B * W target rows
    assert by_label["speculative[B=2,D=2,W=3,P=6,QueryLength]"]["tokens"] == 6
    table = capsys.readouterr().out
    assert "speculative rounds vs decode" in table and "B=2: decode" in table
