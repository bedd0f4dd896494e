"""``flare bench speculation --repeats``: cells are medians over interleaved repeats."""

from __future__ import annotations

from ops.bench_speculation_rows import Row, median_rows


def test_median_rows_one_row_per_mode_and_load_with_each_figures_median() -> None:
    rows = [Row("off", 1, 48, s, 48 / s, 10.0 * s, 0.0, 0.0, mean_gap_ms=12.0 * s)
            for s in (1.0, 3.0, 2.0)]
    rows += [Row("copy:d1", 1, 48, 1.0, 48.0, 9.0, acc, 0.9) for acc in (0.2, 0.6, 0.4)]
    got = {(r.mode, r.streams): r for r in median_rows(rows)}
    assert set(got) == {("off", 1), ("copy:d1", 1)}
    assert got["off", 1].seconds == 2.0 and got["off", 1].tokens_per_s == 24.0
    assert got["off", 1].mean_itl_ms == 20.0 and got["off", 1].mean_gap_ms == 24.0
    assert got["copy:d1", 1].acceptance == 0.4 and got["copy:d1", 1].speculative_share == 0.9


def test_diagnose_reports_each_programs_median_device_interval() -> None:
    """``--diagnose``: per load, the programs run with their median device interval
    (from the frame log) and the scheduler's estimate, beside the host figures."""
    from types import SimpleNamespace

    from actors.planner_records import FrameRecord
    from actors.public import RuntimeStatistics
    from ops.bench_speculation import PlanTimer, diagnose
    from policy.descriptors import GraphKind, GraphShape
    from policy.types import Fence

    def stats(runs: tuple[tuple[str, int], ...]) -> RuntimeStatistics:
        return RuntimeStatistics(
            requests_running=0, requests_waiting=0, kv_pages_used=0, kv_pages_total=0,
            prefix_cache_hit_tokens=0, prompt_tokens_total=0, generation_tokens_total=0,
            executions_by_kind=(), execution_ns_by_kind=(), executions_by_graph=runs)

    ms = 1_000_000
    shape_a = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1)
    a = shape_a.label()
    frames = [FrameRecord(fence=Fence(i), graph=g, lanes=1, launched_ns=10 * i * ms,
                          observed_ns=(10 * i + 9) * ms, device_ns=d * ms)
              for i, (g, d) in enumerate([(a, 8), (a, 6), ("b", 2), (a, 7)])]
    estimates = SimpleNamespace(measured=lambda: {shape_a: 9 * ms})
    rt = SimpleNamespace(frame_log=lambda: tuple(frames),
                         scheduler=SimpleNamespace(estimates=estimates))
    timer = PlanTimer(lambda: None)
    text = diagnose(rt, stats(()),  # type: ignore[arg-type]
                    stats(((a, 3), ("b", 1))),
                    Row("off", 1, 8, 1.0, 8.0, 1.0), timer)
    assert "frames 4, 2.00 tok/frame" in text
    # with the scheduler's estimate where it has one
    assert "programs: 3 decode[B=1] (7.0 ms, est 9.0), 1 b (2.0 ms)" in text
