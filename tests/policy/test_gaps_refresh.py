"""Funded timing refresh gaps through the production scheduler: cancellation during a
refresh (REF-15) and busy/idle cycles that never fund one (REF-20)."""

from __future__ import annotations

from selection_setup import make_decoder
from synthetic_catalog import MS, Driver, decode, duration_ns, measured_scheduler, records_for

from policy import ExecutionTiming, Fence, Scheduler, SelectionReason
from policy.config import PolicyConfig

TTL = 50 * MS


def funded_refresh() -> tuple[Scheduler, list[int]]:
    """decode[B=2] fresh, decode[B=1] and decode[B=4] stale, full credit, two decoders."""
    s = measured_scheduler((decode(1), decode(2), decode(4)),
                           PolicyConfig(estimate_ttl_ns=TTL))
    s.advance_to(s.now_ns + 2 * TTL)
    s.estimates.observe(decode(2), duration_ns(decode(2)), s.now_ns)
    handles = [make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=float(i))
               for i in range(2)]
    s.refresh_ledger.earn(2_495 * MS)
    return s, handles


def test_ref_15_cancelled_refresh_publishes_nothing_and_learns_only_real_intervals() -> None:
    """Covers REF-15, REF-11, ACCT-5: every request of a refresh frame is cancelled while
    it runs. Its completion yields no output (publication suppressed); an interval the
    device did not report changes no estimate (the entry stays stale), while the
    episode still closes and pays its wall time."""
    s, handles = funded_refresh()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    before = s.estimates.estimate_ns(plan.shape)
    s.commit(plan, Fence(1))
    for h in handles:
        s.cancel(h)
    s.advance_to(s.now_ns + 3 * MS)
    out = s.complete(Fence(1), records_for(plan),
                     ExecutionTiming(device_intervals_ns=(0,), wall_ns=3 * MS))
    assert out == []
    assert s.estimates.estimate_ns(plan.shape) == before
    assert s.estimates.is_stale(plan.shape, s.now_ns)
    assert not s.refresh_ledger.episode_open
    assert s.refresh_ledger.balance_ns == 5 * MS - 3 * MS
    assert s.statistics().executions["timing_refresh"] == 1
    assert set(s.take_released()) == set(handles)


def test_ref_15_cancelled_refresh_with_a_device_interval_learns_that_interval() -> None:
    """Covers REF-15: when the cancelled refresh did report a device interval, that
    real observation (and only it) updates the estimate."""
    s, handles = funded_refresh()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    s.commit(plan, Fence(1))
    s.cancel(handles[0])
    s.advance_to(s.now_ns + 7 * MS)
    out = s.complete(Fence(1), records_for(plan),
                     ExecutionTiming(device_intervals_ns=(7 * MS,), wall_ns=8 * MS))
    assert all(g.handle != handles[0] for g in out)
    assert s.estimates.estimate_ns(plan.shape) == 7 * MS
    assert not s.estimates.is_stale(plan.shape, s.now_ns)


def test_ref_20_busy_idle_cycles_never_fund_a_refresh() -> None:
    """Covers REF-20, REF-6, OPEN-8: ten cycles of about one second of ordinary decoding
    separated by idle periods. Each busy second earns ~2 ms of credit, idle discards
    it, so no refresh is ever funded and the unused decode[B=4] stays stale; time alone
    (no timer) never starts a refresh."""
    shapes = (decode(1), decode(4))
    s = measured_scheduler(shapes, PolicyConfig(estimate_ttl_ns=TTL))
    driver = Driver(s)
    max_credit = 0.0
    for _ in range(10):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0,
                     max_output_tokens=125)  # 124 frames of ~8 ms: one busy second
        while (plan := driver.step()) is not None:
            assert plan.reason is not SelectionReason.TIMING_REFRESH
            max_credit = max(max_credit, float(s.refresh_ledger.balance_ns))
        assert not s.handles()
        s.advance_to(s.now_ns + 1_000 * MS)  # idle: nothing resident, nothing in flight
        assert s.refresh_ledger.balance_ns == 0
        assert s.plan() is None  # no timer-driven refresh
        assert s.estimates.is_stale(decode(4), s.now_ns)
    assert 1.5 * MS < max_credit < 5 * MS
    assert s.statistics().executions["timing_refresh"] == 0
    assert s.statistics().executions["ordinary"] >= 10 * 120
