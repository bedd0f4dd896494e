"""Credit ledgers for funded timing refresh and funded acceptance learning.

Covers the ledger level of the seed's *Funded timing refresh* and *Funded acceptance
learning*; which candidate an episode runs is tested with the Scheduler.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.credit_ledgers import (
    FULL_CREDIT_NS,
    CreditLedger,
    LedgerError,
    acceptance_learning_ledger,
    credited_duration_ns,
    episode_charge_ns,
    timing_refresh_ledger,
)
from policy.descriptors import ExecutionTiming

MS = 1_000_000


def test_ref_1_share_of_ordinary_work() -> None:
    """Covers REF-1: 998 ms of ordinary work earns exactly 2 ms."""
    ledger = timing_refresh_ledger()
    ledger.earn(998 * MS)
    assert ledger.balance_ns == 2 * MS
    assert ledger.share == Fraction(2, 998)


def test_lrn_1_acceptance_share() -> None:
    """Covers LRN-1: 99 ms of ordinary work earns exactly 1 ms of acceptance credit."""
    ledger = acceptance_learning_ledger()
    ledger.earn(99 * MS)
    assert ledger.balance_ns == 1 * MS


def test_ref_2_lrn_2_balance_capped_at_full_credit() -> None:
    """Covers REF-2, LRN-2, OPEN-6: 10 s earns only 5 ms; the cap is on the balance."""
    for ledger in (timing_refresh_ledger(), acceptance_learning_ledger()):
        ledger.earn(10_000 * MS)
        assert ledger.balance_ns == FULL_CREDIT_NS == 5 * MS
        ledger.earn(1)
        assert ledger.balance_ns == 5 * MS


def test_ref_19_open_6_2494_ms_does_not_fund_2495_does() -> None:
    """Covers REF-19, OPEN-6: exact arithmetic at the funding threshold."""
    ledger = timing_refresh_ledger()
    ledger.earn(2_494 * MS)
    assert not ledger.funded()
    assert ledger.balance_ns == Fraction(2 * 2_494 * MS, 998)
    ledger.earn(1 * MS)
    assert ledger.funded()
    assert ledger.balance_ns == 5 * MS


def test_ref_19_threshold_reached_from_many_small_executions() -> None:
    """Covers REF-19: 2,495 executions of 1 ms fund exactly at the last one (no rounding drift)."""
    ledger = timing_refresh_ledger()
    for _ in range(2_494):
        ledger.earn(1 * MS)
    assert not ledger.funded()
    ledger.earn(1 * MS)
    assert ledger.funded()


def test_lrn_2_acceptance_full_credit_first_at_495_ms() -> None:
    """Covers LRN-2: 494 ms not funded, 495 ms funded."""
    ledger = acceptance_learning_ledger()
    ledger.earn(494 * MS)
    assert not ledger.funded()
    ledger.earn(1 * MS)
    assert ledger.funded()


def test_ref_3_4_open_7_credited_duration() -> None:
    """Covers REF-3, REF-4, OPEN-7, LRN-20: queued = device, isolated = max(device, wall), raw."""
    t = ExecutionTiming(device_intervals_ns=(8 * MS, 3 * MS), wall_ns=20 * MS,
                        readiness_delay_ns=2 * MS)
    assert credited_duration_ns(t, isolated=False) == 8 * MS
    assert credited_duration_ns(t, isolated=True) == 20 * MS
    slow_device = ExecutionTiming(device_intervals_ns=(30 * MS,), wall_ns=20 * MS)
    assert credited_duration_ns(slow_device, isolated=True) == 30 * MS
    invalid = ExecutionTiming(device_intervals_ns=(0,), wall_ns=20 * MS)
    assert credited_duration_ns(invalid, isolated=True) == 0


def test_ref_11_14_lrn_11_episode_charges() -> None:
    """Covers REF-11, REF-14, LRN-11, LRN-20: raw interval incl. readiness; wall if invalid."""
    t = ExecutionTiming(device_intervals_ns=(9 * MS,), wall_ns=4 * MS, readiness_delay_ns=2 * MS)
    assert episode_charge_ns(t) == 9 * MS  # not the 7 ms cost sample
    assert episode_charge_ns(t, isolated=False) == 9 * MS
    slow_host = ExecutionTiming(device_intervals_ns=(9 * MS,), wall_ns=12 * MS)
    assert episode_charge_ns(slow_host) == 12 * MS
    invalid = ExecutionTiming(device_intervals_ns=(0, 0), wall_ns=15 * MS)
    assert episode_charge_ns(invalid) == 15 * MS


def test_ref_6_lrn_16_open_8_idle_discards_credit_keeps_debt() -> None:
    """Covers REF-6, LRN-16, OPEN-8: +3 ms -> 0; -4 ms stays -4 ms."""
    for ledger in (timing_refresh_ledger(), acceptance_learning_ledger()):
        ledger.earn(int(3 * MS / ledger.share))
        assert ledger.balance_ns == 3 * MS
        ledger.on_idle()
        assert ledger.balance_ns == 0
        ledger.earn(10_000 * MS)
        ledger.begin_episode()
        ledger.charge(9 * MS)
        ledger.end_episode()
        assert ledger.balance_ns == -4 * MS
        ledger.on_idle()
        assert ledger.balance_ns == -4 * MS


def test_ref_17_lrn_14_started_episode_may_incur_debt() -> None:
    """Covers REF-17, LRN-14: a 50 ms refresh may start on 5 ms of credit; debt is repaid."""
    ledger = timing_refresh_ledger()
    ledger.earn(2_495 * MS)
    ledger.begin_episode()
    ledger.charge(50 * MS)
    ledger.end_episode()
    assert ledger.balance_ns == -45 * MS
    assert not ledger.funded()
    # Repaying 45 ms of debt and re-earning 5 ms takes 50 / (2/998) ms of ordinary work.
    ledger.earn(24_950 * MS - 1)
    assert not ledger.funded()
    ledger.earn(1)
    assert ledger.funded()


def test_ref_16_lrn_15_one_episode_then_full_credit_again() -> None:
    """Covers REF-16, LRN-8, LRN-15: no second episode while open or before full credit."""
    ledger = acceptance_learning_ledger()
    ledger.earn(495 * MS)
    ledger.begin_episode()
    assert ledger.episode_open and not ledger.funded()
    with pytest.raises(LedgerError):
        ledger.begin_episode()
    ledger.charge(2 * MS)
    ledger.earn(99 * MS)  # credit earned meanwhile still counts
    ledger.end_episode()
    assert ledger.balance_ns == 4 * MS and not ledger.funded()
    with pytest.raises(LedgerError):
        ledger.begin_episode()
    ledger.earn(99 * MS)
    assert ledger.funded()


def test_episode_calls_out_of_order_are_refused() -> None:
    ledger = timing_refresh_ledger()
    with pytest.raises(LedgerError):
        ledger.charge(1)
    with pytest.raises(LedgerError):
        ledger.end_episode()
    with pytest.raises(ValueError):
        ledger.earn(-1)
    with pytest.raises(ValueError):
        CreditLedger(1, 0)


def test_ref_20_short_busy_periods_separated_by_idle_never_fund() -> None:
    """Covers REF-20: 1 s busy / idle cycles never fund a refresh."""
    ledger = timing_refresh_ledger()
    for _ in range(1_000):
        for _ in range(100):
            ledger.earn(10 * MS)
            assert not ledger.funded()
        ledger.on_idle()
    assert ledger.balance_ns == 0


def _bound(ledger: CreditLedger) -> bool:
    p, o, d = ledger.episodes_ns, ledger.ordinary_ns, ledger.current_or_last_episode_ns
    return p <= ledger.share * o + d


def test_ref_18_bound_needs_the_last_episode_term() -> None:
    """Covers REF-18: one overrun can exceed share*O, never share*O + D."""
    ledger = timing_refresh_ledger()
    ledger.earn(2_495 * MS)
    ledger.begin_episode()
    ledger.charge(50 * MS)
    assert ledger.episodes_ns > ledger.share * ledger.ordinary_ns
    assert ledger.bound_holds() and _bound(ledger)


_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("earn"), st.integers(0, 400 * MS)),
        st.tuples(st.just("idle"), st.just(0)),
        st.tuples(st.just("episode"), st.integers(0, 80 * MS)),
    ),
    max_size=200,
)


@settings(max_examples=80, deadline=None)
@given(_OPERATIONS, st.sampled_from(["refresh", "acceptance"]))
def test_ref_18_lrn_17_bound_holds_at_every_step(
    operations: list[tuple[str, int]], which: str
) -> None:
    """Covers REF-18, LRN-17 (property): P <= share*O + D after every public call."""
    ledger = timing_refresh_ledger() if which == "refresh" else acceptance_learning_ledger()
    for op, ns in operations:
        if op == "earn":
            ledger.earn(ns)
        elif op == "idle":
            ledger.on_idle()
        elif ledger.funded():
            ledger.begin_episode()
            assert ledger.bound_holds()
            # An episode may be paid in more than one charge (e.g. a cancelled, then
            # re-observed frame); it is one episode either way.
            ledger.charge(ns // 2)
            assert _bound(ledger)
            ledger.charge(ns - ns // 2)
            ledger.end_episode()
        assert ledger.bound_holds() and _bound(ledger)
        assert ledger.balance_ns <= ledger.full_credit_ns


def test_ref_18_lrn_17_long_synthetic_run() -> None:
    """Covers REF-18, LRN-17: 50,000 steps of ordinary work, idles and funded episodes.

    Both ledgers run side by side; an execution charges at most one of them (LRN-13) and
    timing refresh goes first (LRN-7). The bound is checked exactly after every step, and
    the run must actually exercise episodes and debt for the test to mean anything.
    """
    rng = np.random.default_rng(20261129)
    refresh, learning = timing_refresh_ledger(), acceptance_learning_ledger()
    episodes = {"refresh": 0, "acceptance": 0}
    saw_debt = False
    for _ in range(50_000):
        roll = rng.random()
        if roll < 0.002:
            refresh.on_idle()
            learning.on_idle()
        elif refresh.funded() and roll < 0.5:
            refresh.begin_episode()
            refresh.charge(int(rng.integers(1, 60 * MS)))
            refresh.end_episode()
            episodes["refresh"] += 1
        elif learning.funded() and roll < 0.6:
            learning.begin_episode()
            learning.charge(int(rng.integers(1, 60 * MS)))
            learning.end_episode()
            episodes["acceptance"] += 1
        else:
            ordinary = int(rng.integers(1, 40 * MS))
            refresh.earn(ordinary)
            learning.earn(ordinary)
        saw_debt |= refresh.balance_ns < 0 or learning.balance_ns < 0
        assert refresh.bound_holds() and learning.bound_holds()
    assert episodes["refresh"] > 10 and episodes["acceptance"] > 10
    assert saw_debt
