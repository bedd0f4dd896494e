"""flare's shared speed factor over the duration estimates (``policy/cost_drift.py``).

Not a seed rule: an opt-in departure from DUR-8/DUR-9 (``PolicyConfig.cost_drift_weight``
> 0); weight 0 keeps the seed's ``DurationEstimates``, whose tests stay as they are."""

from __future__ import annotations

import math

import pytest
from decoding import decoding
from synthetic_catalog import Driver, decode, measured_scheduler, prefill

from actors.config import CPU_COST_DRIFT_WEIGHT
from policy.baselines.factory import make_policy
from policy.catalog_index import CatalogIndex
from policy.config import PolicyConfig, PolicyConfigError
from policy.cost_drift import MAX_RESIDUAL, DriftingEstimates, estimates_for, reconfigured
from policy.descriptors import GraphShape
from policy.duration_estimates import DurationEstimates
from policy.estimate_cache import EstimateCache
from policy.service import normalizers_from_catalog

MS = 1_000_000
TTL = 30_000 * MS


def test_weight_zero_is_the_seeds_estimates() -> None:
    assert type(estimates_for(PolicyConfig())) is DurationEstimates
    assert isinstance(estimates_for(PolicyConfig(cost_drift_weight=0.1)), DriftingEstimates)
    assert type(make_policy("balanced", PolicyConfig()).estimates) is DurationEstimates
    assert isinstance(make_policy("fcfs", PolicyConfig(cost_drift_weight=0.1)).estimates,
                      DriftingEstimates)


def test_a_speed_change_seen_on_one_shape_moves_the_estimate_of_a_shape_not_run() -> None:
    seed, drifting = DurationEstimates(TTL), DriftingEstimates(TTL, weight=0.1)
    for est in (seed, drifting):
        est.observe(decode(8), 4 * MS, now_ns=1)
        est.observe(decode(16), 6 * MS, now_ns=1)
        for t in range(60):  # the machine got 1.6x faster; only decode(8) runs
            est.observe(decode(8), round(2.5 * MS), now_ns=2 + t)
    assert seed.estimate_ns(decode(16)) == 6 * MS
    # most of the change reaches the shape not run (its own base keeps a fifth of it)
    assert drifting.estimate_ns(decode(16)) == pytest.approx(6 * MS / 1.6, rel=0.12)
    assert drifting.estimate_ns(decode(8)) == pytest.approx(2.5 * MS, rel=0.02)
    assert drifting.measured() == {decode(8): drifting.estimate_ns(decode(8)),
                                   decode(16): drifting.estimate_ns(decode(16))}


def test_one_stalled_frame_moves_the_speed_factor_by_at_most_the_weight_times_ln2() -> None:
    est = DriftingEstimates(TTL, weight=0.1)
    est.observe(decode(8), 4 * MS, now_ns=1)
    est.observe(decode(8), 400 * MS, now_ns=2)
    assert est.log_speed == pytest.approx(0.1 * MAX_RESIDUAL)
    assert est.estimate_ns(decode(8)) < 4 * MS * 1.1


def test_a_first_sample_and_a_stale_shapes_sample_set_the_estimate_directly() -> None:
    est = DriftingEstimates(TTL, weight=0.5)
    est.observe(decode(8), 4 * MS, now_ns=1)
    for t in range(20):
        est.observe(decode(8), 2 * MS, now_ns=2 + t)
    assert est.log_speed < -0.3
    est.observe(decode(16), 5 * MS, now_ns=30)  # unknown: its first sample is its cost
    assert est.estimate_ns(decode(16)) == pytest.approx(5 * MS, abs=1)
    est.observe(decode(16), 9 * MS, now_ns=30 + TTL)  # stale: replaced (DUR-12)
    assert est.estimate_ns(decode(16)) == pytest.approx(9 * MS, abs=1)
    assert est.is_fresh(decode(16), 31 + TTL)


def test_samples_that_are_not_positive_change_nothing() -> None:
    est = DriftingEstimates(TTL, weight=0.1)
    est.observe(decode(8), 4 * MS, now_ns=1)
    assert not est.observe(decode(8), 0, now_ns=2)
    assert (est.log_speed, est.estimate_ns(decode(8))) == (0.0, 4 * MS)


def test_reconfiguring_the_weight_keeps_the_measured_samples() -> None:
    seed = DurationEstimates(TTL)
    seed.observe(decode(8), 4 * MS, now_ns=5)
    drifting = reconfigured(seed, PolicyConfig(cost_drift_weight=0.1))
    assert isinstance(drifting, DriftingEstimates)
    assert drifting.estimate_ns(decode(8)) == 4 * MS
    assert drifting.last_valid_ns(decode(8)) == 5
    longer = PolicyConfig(cost_drift_weight=0.1, estimate_ttl_ns=2 * TTL)
    assert reconfigured(drifting, longer) is drifting and drifting.ttl_ns == 2 * TTL
    back = reconfigured(drifting, PolicyConfig())
    assert type(back) is DurationEstimates and back.estimate_ns(decode(8)) == 4 * MS


SLOW = 1.6
"""How much slower the machine was when decode(16) was last measured."""


def intrinsic_ns(shape: GraphShape) -> int:
    """Costs with the shape of the embedded model on the CPU: two decode(8) steps cost
    more than one decode(16) (2.9 + 2.9 > 4.3 ms)."""
    return {8: round(2.9 * MS), 16: round(4.3 * MS)}[shape.batch_capacity]


def halves_after_a_slow_moment(weight: float) -> list[tuple[int, int]]:
    """16 decoders join 8 whose decode(8) frames were re-measured after a slow moment
    that left decode(16) at 1.6x its cost; (batch capacity, lanes) of the frames after."""
    s = measured_scheduler((decode(8), decode(16)), PolicyConfig(cost_drift_weight=weight),
                           lambda shape: round(intrinsic_ns(shape) * SLOW))
    for _ in range(8):
        decoding(s, max_output_tokens=10_000, visible_ago_ns=0)
    driver = Driver(s, intrinsic_ns)
    driver.run(30)
    for _ in range(8):
        decoding(s, max_output_tokens=10_000, visible_ago_ns=0)
    after = len(driver.trace.plans)
    driver.run(20)
    return [(p.shape.batch_capacity, len(p.lanes)) for p in driver.trace.plans[after:]]


def test_seed_estimates_split_sixteen_decoders_into_halves_after_a_slow_moment() -> None:
    """The failure the shared factor exists for: decode(16) keeps its slow cost, two
    freshly measured decode(8) frames look cheaper, and it is never chosen again."""
    assert set(halves_after_a_slow_moment(0.0)) == {(8, 8)}


def test_a_shared_speed_factor_serves_sixteen_decoders_in_one_frame() -> None:
    assert set(halves_after_a_slow_moment(CPU_COST_DRIFT_WEIGHT)) == {(16, 16)}


def test_the_weight_is_a_validated_preference() -> None:
    assert PolicyConfig().cost_drift_weight == 0.0  # every preset: the seed's
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(PolicyConfigError, match="cost_drift_weight"):
            PolicyConfig(cost_drift_weight=bad)
    PolicyConfig(cost_drift_weight=1.0)


def test_the_estimate_cache_rescales_to_what_a_fresh_build_reads() -> None:
    """With a shared speed factor every sample moves every estimate. The cache rescales
    its arrays in place instead of rebuilding them; after a known shape's sample, a
    first sample, a stale shape's sample, a sample of a shape outside the catalog and an
    attempt, its arrays and its normalizers are what a cache built from scratch reads, and
    its derived values go whenever an estimate moved."""
    shapes = (decode(1), decode(4), decode(8), decode(16), prefill(64), prefill(256))
    catalog = CatalogIndex.build(shapes)
    est = DriftingEstimates(TTL, weight=0.1)
    for i, shape in enumerate(shapes[:-1]):
        est.observe(shape, (3 + i) * MS, now_ns=1)
    cache = EstimateCache(est)
    times = cache.shape_times(catalog)
    steps = [(decode(4), 2 * MS, 2), (prefill(256), 9 * MS, 3),  # a first sample
             (decode(8), 8 * MS, TTL + 10), (decode(16), 4 * MS, TTL + 11),  # stale
             (decode(2), MS // 10, TTL + 12),  # outside the catalog: the fastest rate
             (decode(2), 3 * MS // 20, TTL + 13)]  # ... and moving every catalog estimate
    for shape, sample_ns, now_ns in steps:
        times.sigma_memo[("derived", 0)] = 1.0
        before = times.estimate_ns.tolist()
        cache.record_attempt(catalog, shape, now_ns)
        cache.observe(catalog, shape, sample_ns, now_ns)
        fresh = EstimateCache(est).shape_times(catalog)
        assert cache.shape_times(catalog) is times
        for name in ("estimate_ns", "last_valid_ns", "last_touched_ns"):
            assert getattr(times, name).tolist() == getattr(fresh, name).tolist(), name
        assert times.stale_at(now_ns, TTL).tolist() == fresh.stale(now_ns, TTL).tolist()
        assert bool(times.sigma_memo) == (times.estimate_ns.tolist() == before)
        assert cache.normalizers(4) == normalizers_from_catalog(est.measured(), 4)
    assert est.log_speed != 0.0
