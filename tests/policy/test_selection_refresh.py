"""Funded timing refresh through the production scheduler (seed: *Funded timing
refresh*; the ledger arithmetic itself is tested in test_credit_ledgers.py)."""

from __future__ import annotations

import random

import pytest
from selection_setup import make_decoder, make_prompt
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    ordinary_catalog,
    records_for,
)

from policy import ExecutionTiming, Fence, Scheduler, SelectionReason
from policy.config import PolicyConfig

TTL = 50 * MS


def funded_with_stale_alternative() -> Scheduler:
    """decode[B=2] fresh, decode[B=1] and decode[B=4] stale, full credit."""
    s = measured_scheduler((decode(1), decode(2), decode(4)),
                           PolicyConfig(estimate_ttl_ns=TTL))
    s.advance_to(s.now_ns + 2 * TTL)
    s.estimates.observe(decode(2), duration_ns(decode(2)), s.now_ns)
    for i in range(2):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=float(i))
    s.refresh_ledger.earn(2_495 * MS)
    return s


def test_ref_7_full_credit_lets_stale_alternative_displace_winner() -> None:
    """Covers REF-7, REF-13, REF-14, REF-16, SEL-37."""
    s = funded_with_stale_alternative()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    assert plan.shape != decode(2) and plan.stale and plan.requires_empty_window
    trace = s.commit(plan, Fence(1))
    assert trace.reason is SelectionReason.TIMING_REFRESH
    assert s.refresh_ledger.episode_open
    d = duration_ns(plan.shape)
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(d,),
                                                            wall_ns=d))
    assert not s.refresh_ledger.episode_open
    assert s.refresh_ledger.balance_ns == 5 * MS - d  # paid once
    assert not s.estimates.is_stale(plan.shape, s.now_ns)
    following = s.plan()
    assert following is not None and following.reason is SelectionReason.ORDINARY
    assert s.statistics().executions["timing_refresh"] == 1


def test_ref_8_least_recently_touched_stale_alternative_first() -> None:
    """Covers REF-8, OPEN-9: decode[B=4] was attempted more recently than decode[B=1]."""
    s = funded_with_stale_alternative()
    s.estimates.record_attempt(decode(4), s.now_ns - 1)
    plan = s.plan()
    assert plan is not None and plan.shape == decode(1)
    s2 = funded_with_stale_alternative()
    s2.estimates.record_attempt(decode(1), s2.now_ns - 1)
    plan2 = s2.plan()
    assert plan2 is not None and plan2.shape == decode(4)


def test_ref_9_plan_without_commit_does_not_advance_attempts() -> None:
    """Covers REF-9."""
    s = funded_with_stale_alternative()
    before = {shape: s.estimates.last_touched_ns(shape) for shape in s.catalog}
    s.plan()
    s.plan()
    assert {shape: s.estimates.last_touched_ns(shape) for shape in s.catalog} == before


def test_ref_10_11_invalid_timing_keeps_entry_stale_and_pays_wall_time() -> None:
    """Covers REF-10, REF-11, DUR-19."""
    s = funded_with_stale_alternative()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    s.commit(plan, Fence(1))
    s.advance_to(s.now_ns + 7 * MS)
    s.complete(Fence(1), records_for(plan),
               ExecutionTiming(device_intervals_ns=(0,), wall_ns=7 * MS))
    assert s.estimates.is_stale(plan.shape, s.now_ns)
    assert s.refresh_ledger.balance_ns == 5 * MS - 7 * MS


def test_ref_12_stale_ordinary_winner_refreshes_without_credit() -> None:
    """Covers REF-12: no credit, a stale winner runs as ordinary and becomes fresh."""
    s = measured_scheduler((decode(2),), PolicyConfig(estimate_ttl_ns=TTL))
    s.advance_to(s.now_ns + 2 * TTL)
    for i in range(2):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=float(i))
    s.refresh_ledger.earn(2_495 * MS)
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ORDINARY and plan.stale
    s.commit(plan, Fence(1))
    d = duration_ns(decode(2))
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(d,),
                                                            wall_ns=d))
    assert s.refresh_ledger.balance_ns == 5 * MS
    assert not s.estimates.is_stale(decode(2), s.now_ns)


def test_ref_5_discovery_earns_no_credit() -> None:
    """Covers REF-5."""
    s = Scheduler(catalog=(decode(1),))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    d = Driver(s)
    d.step()
    assert d.trace.plans[0].reason is SelectionReason.DISCOVERY
    assert s.refresh_ledger.balance_ns == 0


@pytest.mark.slow
def test_ref_18_aggregate_bound_over_long_synthetic_run() -> None:
    """Covers REF-18, REF-17, VER-9 (expiry and recovery): a long randomized run with a
    short freshness interval; the bound holds after every step and refreshes happen."""
    rng = random.Random(18)
    s = measured_scheduler(ordinary_catalog(), PolicyConfig(estimate_ttl_ns=200 * MS))
    d = Driver(s, durations=lambda shape: round(duration_ns(shape) * rng.uniform(0.8, 1.3)))
    for step in range(3000):
        live = [h for h in s.handles()]
        if len(live) < 6 and rng.random() < 0.2:
            make_prompt(s, prompt_len=rng.randint(16, 3000), token_rate=1.0)
        if d.step() is None:
            s.advance_to(s.now_ns + MS)
        if step % 400 == 399:
            s.advance_to(s.now_ns + rng.randint(0, 300) * MS)
        ledger = s.refresh_ledger
        assert ledger.bound_holds(), step
    stats = s.statistics()
    assert stats.executions["timing_refresh"] >= 1
    assert stats.executions["ordinary"] > 1000
