"""Duration estimates (seed: Duration estimates; DUR-1, DUR-2, DUR-3, DUR-4, DUR-5, DUR-6, DUR-7, DUR-8, DUR-9, DUR-10, DUR-11, DUR-12, DUR-13, DUR-14, DUR-15, DUR-16, DUR-17, DUR-18, DUR-19, DUR-28, CAT-8, OPEN-10, OPEN-11)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.duration_estimates import DurationEstimates, median_ns

MS = 1_000_000
TTL = 30_000 * MS


def decode(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1, packed_capacity=b)


def spec(b: int, d: int, w: int, p: int) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=d, packed_capacity=p, binding=TargetBinding.QUERY_LENGTH)


def mixed(b: int, w: int, c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=w,
                      prefill_capacity=c, packed_capacity=c + (b - 1) * w)


def test_dur_1_2_3_estimates_start_at_zero_meaning_unknown() -> None:
    """Covers DUR-1, DUR-2, DUR-3: one ns estimate per shape, zero until measured."""
    est = DurationEstimates()
    assert est.estimate_ns(decode(4)) == 0
    assert not est.is_known(decode(4))
    assert not est.is_stale(decode(4), 10 * TTL)
    assert est.measured() == {}
    assert est.last_touched_ns(decode(4)) == 0


def test_dur_8_first_positive_sample_sets() -> None:
    """Covers DUR-8."""
    est = DurationEstimates()
    assert est.observe(decode(4), 7 * MS, now_ns=1)
    assert est.estimate_ns(decode(4)) == 7 * MS
    assert est.is_known(decode(4))


def test_dur_9_median_of_last_nine_with_middle_pair_average() -> None:
    """Covers DUR-9: 1,2,3,10 ms -> 2.5 ms; with ten samples only the last nine count."""
    est = DurationEstimates()
    s = decode(2)
    for i, ms in enumerate((1, 2, 3, 10)):
        est.observe(s, ms * MS, now_ns=i)
    assert est.estimate_ns(s) == 2_500_000
    est2 = DurationEstimates()
    # The first sample (100 ms) falls out of the window with the tenth.
    samples = [100, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    for i, ms in enumerate(samples):
        est2.observe(s, ms * MS, now_ns=i)
    assert est2.samples(s) == tuple(ms * MS for ms in samples[1:])
    assert est2.estimate_ns(s) == 5 * MS  # median of 1..9; with 100 it would be 5.5


@settings(deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10**12), min_size=1, max_size=30))
def test_dur_9_matches_statistics_median_of_window(samples: list[int]) -> None:
    """Covers DUR-8, DUR-9: fresh estimates equal the median of the last nine (floored)."""
    est = DurationEstimates()
    s = decode(8)
    for i, v in enumerate(samples):
        est.observe(s, v, now_ns=i)
    window = samples[-9:]
    assert est.estimate_ns(s) == int(statistics.median(window) // 1)
    assert est.estimate_ns(s) == median_ns(window)


def test_dur_4_identity_is_the_whole_physical_shape() -> None:
    """Covers DUR-4, DUR-7, OPEN-27: any differing capacity is a different entry."""
    base = spec(4, 3, 4, 16)
    variants = [spec(8, 3, 4, 32), spec(4, 5, 6, 16), spec(4, 3, 4, 12), spec(4, 2, 4, 16)]
    est = DurationEstimates()
    est.observe(base, 9 * MS, now_ns=0)
    for v in variants:
        assert est.estimate_ns(v) == 0
    m1, m2 = mixed(4, 2, 128), mixed(4, 2, 256)
    est.observe(m1, 3 * MS, now_ns=0)
    assert est.estimate_ns(m2) == 0
    # Equal values are the same entry (a fresh object with the same fields).
    assert est.estimate_ns(spec(4, 3, 4, 16)) == 9 * MS


def test_dur_5_active_rows_do_not_change_identity() -> None:
    """Covers DUR-5: B=4 runs with 3 and with 4 rows update the same entry.

    The cost catalog is keyed by shape alone; the row count is not even an argument.
    """
    est = DurationEstimates()
    est.observe(decode(4), 4 * MS, now_ns=0)  # a run with 3 active rows
    est.observe(decode(4), 6 * MS, now_ns=1)  # a run with 4 active rows
    assert est.samples(decode(4)) == (4 * MS, 6 * MS)
    assert est.estimate_ns(decode(4)) == 5 * MS


def test_dur_10_open_11_stale_at_exactly_ttl() -> None:
    """Covers DUR-10, OPEN-11: fresh before ttl, stale at now - last_valid >= ttl."""
    est = DurationEstimates()
    s = decode(1)
    est.observe(s, 5 * MS, now_ns=1_000)
    assert not est.is_stale(s, 1_000 + 29_900 * MS)
    assert not est.is_stale(s, 1_000 + TTL - 1)
    assert est.is_stale(s, 1_000 + TTL)
    assert est.is_stale(s, 1_000 + 30_100 * MS)
    assert est.is_fresh(s, 1_000 + TTL - 1) and not est.is_fresh(s, 1_000 + TTL)


def test_dur_11_13_cat_8_stale_estimate_keeps_its_median() -> None:
    """Covers DUR-11, DUR-13, CAT-8: 31 s or an hour later it is the last median, still known."""
    est = DurationEstimates()
    s = decode(4)
    for i, ms in enumerate((10, 12, 30)):
        est.observe(s, ms * MS, now_ns=i)
    assert est.estimate_ns(s) == 12 * MS
    for later in (31_000 * MS, 3_600_000 * MS):
        assert est.is_stale(s, later)
        assert est.estimate_ns(s) == 12 * MS
        assert est.is_known(s)
    assert est.measured() == {s: 12 * MS}


def test_dur_12_open_10_stale_entry_replaced_and_window_restarts() -> None:
    """Covers DUR-12, OPEN-10: stale 10 ms + sample 20 ms -> 20 ms; the new window starts there."""
    est = DurationEstimates()
    s = decode(4)
    for i in range(5):
        est.observe(s, 10 * MS, now_ns=i)
    t = 40_000 * MS
    assert est.is_stale(s, t)
    assert est.observe(s, 20 * MS, now_ns=t)
    assert est.estimate_ns(s) == 20 * MS
    assert not est.is_stale(s, t)
    assert est.samples(s) == (20 * MS,)
    est.observe(s, 30 * MS, now_ns=t + 1)
    assert est.estimate_ns(s) == 25 * MS  # median of (20, 30), not of the old 10 ms samples


def test_dur_19_ref_10_zero_samples_change_nothing() -> None:
    """Covers DUR-19, REF-10: a zero or negative sample neither changes nor refreshes."""
    est = DurationEstimates()
    s = decode(2)
    assert not est.observe(s, 0, now_ns=5)
    assert est.estimate_ns(s) == 0 and est.last_touched_ns(s) == 0
    est.observe(s, 8 * MS, now_ns=0)
    t = TTL + 1
    assert est.is_stale(s, t)
    assert not est.observe(s, 0, now_ns=t)
    assert not est.observe(s, -3, now_ns=t)
    assert est.is_stale(s, t)
    assert est.estimate_ns(s) == 8 * MS
    assert est.last_valid_ns(s) == 0


def test_dur_14_15_18_samples_come_from_device_intervals() -> None:
    """Covers DUR-14, DUR-15, DUR-18, ACC-31: max rank interval less readiness; wall ignored."""
    est = DurationEstimates()
    s = decode(2)
    timing = ExecutionTiming(device_intervals_ns=(5 * MS, 9 * MS), wall_ns=500 * MS,
                             readiness_delay_ns=2 * MS)
    est.observe(s, timing.cost_sample_ns, now_ns=0)
    assert est.estimate_ns(s) == 7 * MS
    missing = ExecutionTiming(device_intervals_ns=(0, 0), wall_ns=20 * MS)
    assert not est.observe(s, missing.cost_sample_ns, now_ns=1)
    assert est.estimate_ns(s) == 7 * MS


def test_ref_8_9_last_touched_is_later_of_observation_and_attempt() -> None:
    """Covers REF-8, REF-9, OPEN-9: attempts are recorded only when committed (explicitly)."""
    est = DurationEstimates()
    a, b = decode(2), decode(4)
    est.observe(a, 5 * MS, now_ns=100)
    est.observe(b, 5 * MS, now_ns=200)
    assert est.last_touched_ns(a) == 100
    est.record_attempt(a, 300)
    assert est.last_touched_ns(a) == 300
    est.record_attempt(a, 250)  # an out-of-order report never moves it back
    assert est.last_touched_ns(a) == 300
    est.observe(a, 6 * MS, now_ns=400)
    assert est.last_touched_ns(a) == 400
    # An attempt alone does not make an unknown shape known.
    c = decode(8)
    est.record_attempt(c, 500)
    assert est.last_touched_ns(c) == 500 and not est.is_known(c)
    assert c not in est.measured()


def test_dur_28_freshness_is_rechecked_at_any_later_time() -> None:
    """Covers DUR-28: freshness is a function of the time asked, so commit can recheck it."""
    est = DurationEstimates()
    s = decode(4)
    est.observe(s, 5 * MS, now_ns=0)
    planned_at, committed_at = 1 * MS, 31_000 * MS
    assert est.is_fresh(s, planned_at)
    assert not est.is_fresh(s, committed_at) and est.is_stale(s, committed_at)


def test_observation_age_and_ttl_setting() -> None:
    est = DurationEstimates(ttl_ns=10)
    s = decode(1)
    assert est.observation_age_ns(s, 5) is None
    est.observe(s, 3, now_ns=4)
    assert est.observation_age_ns(s, 9) == 5
    assert est.is_stale(s, 14)
    est.ttl_ns = 100
    assert not est.is_stale(s, 14)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="ttl"):
            DurationEstimates(ttl_ns=bad)
