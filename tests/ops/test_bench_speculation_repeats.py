"""``flare bench speculation --repeats``: cells are medians over interleaved repeats."""

from __future__ import annotations

from ops.bench_speculation import Row, median_rows


def test_median_rows_one_row_per_mode_and_load_with_each_figures_median() -> None:
    rows = [Row("off", 1, 48, s, 48 / s, 10.0 * s, 0.0, 0.0) for s in (1.0, 3.0, 2.0)]
    rows += [Row("copy:d1", 1, 48, 1.0, 48.0, 9.0, acc, 0.9) for acc in (0.2, 0.6, 0.4)]
    got = {(r.mode, r.streams): r for r in median_rows(rows)}
    assert set(got) == {("off", 1), ("copy:d1", 1)}
    assert got["off", 1].seconds == 2.0 and got["off", 1].tokens_per_s == 24.0
    assert got["off", 1].mean_itl_ms == 20.0
    assert got["copy:d1", 1].acceptance == 0.4 and got["copy:d1", 1].speculative_share == 0.9
