"""The checkpoint extra-work allowance ledger (``policy/checkpoint_allowance.py``):
QUEUE-20..26 as a pure, per-request ledger."""

from __future__ import annotations

from fractions import Fraction

import pytest

from policy.checkpoint_allowance import (
    CheckpointAllowance,
    copy_after_split,
    estimated_prefill_ns,
    plan_capture,
)
from policy.config import PolicyConfig

MS = 1_000_000


def test_queue_21_default_fraction_is_five_percent() -> None:
    allowance = CheckpointAllowance(PolicyConfig().checkpoint_extra_work_fraction)
    assert allowance.fraction == Fraction(1, 20)


def test_estimated_prefill_covers_the_tokens_with_the_cheapest_measured_capacity() -> None:
    # 300 tokens: 5 chunks of 64 (5 * 2 ms) vs 2 chunks of 256 (2 * 6 ms) vs 1 of 1024.
    costs = [(64, 2 * MS), (256, 6 * MS), (1024, 30 * MS)]
    assert estimated_prefill_ns(300, costs) == 10 * MS
    assert estimated_prefill_ns(600, costs) == 18 * MS  # 3 * 6 ms beats 10 * 2 ms
    assert estimated_prefill_ns(0, costs) == 0
    # Unmeasured shapes (estimate 0) do not count; none measured: unknown.
    assert estimated_prefill_ns(300, [(64, 0), (256, 6 * MS)]) == 12 * MS
    assert estimated_prefill_ns(300, [(64, 0), (256, 0)]) is None


def test_queue_20_an_extra_whose_cost_exceeds_the_allowance_is_not_planned() -> None:
    allowance = CheckpointAllowance(0.05, prefill_work_ns=40 * MS)  # room: 2 ms
    assert allowance.allows_extra(2 * MS)
    assert not allowance.allows_extra(2 * MS + 1)
    assert plan_capture(allowance, split_ns=MS, copy_ns=MS + 1,
                        destination_obtainable=True) is None
    assert allowance.spent_ns == 0  # a refused plan charges nothing
    planned = plan_capture(allowance, split_ns=MS, copy_ns=MS, destination_obtainable=True)
    assert planned is not None and allowance.spent_ns == 2 * MS
    assert not allowance.allows_extra(1)  # the room is spent


def test_queue_22_unknown_costs_disable_extras() -> None:
    """An unmeasured copy (0 or None) or an unknown prefill estimate: no extra."""
    known = CheckpointAllowance(0.05, prefill_work_ns=100 * MS)
    assert not known.allows_extra(0)
    assert not known.allows_extra(None)
    assert plan_capture(known, split_ns=0, copy_ns=None, destination_obtainable=True) is None
    assert plan_capture(known, split_ns=None, copy_ns=MS, destination_obtainable=True) is None
    unknown_prefill = CheckpointAllowance(0.05)
    assert unknown_prefill.extra_room_ns() is None
    assert not unknown_prefill.allows_extra(1)
    # Learning the estimate later enables extras; a known estimate is never replaced.
    unknown_prefill.ensure_prefill_estimate(100 * MS)
    unknown_prefill.ensure_prefill_estimate(1)
    assert unknown_prefill.allows_extra(5 * MS)


def test_queue_23_decode_earns_the_fraction_for_a_distinct_terminal_capture() -> None:
    """100 ms of productive decode -> exactly 5 ms of terminal-capture allowance."""
    allowance = CheckpointAllowance(0.05, prefill_work_ns=0)
    for _ in range(4):
        allowance.earn_decode(25 * MS)
    allowance.earn_decode(0)  # a missing interval earns nothing (DUR-19)
    assert allowance.terminal_room_ns(distinct=True) == 5 * MS
    assert allowance.allows_terminal(5 * MS, distinct=True)
    assert not allowance.allows_terminal(5 * MS + 1, distinct=True)
    # Not distinct (the terminal endpoint is an anchor already captured): decode
    # earnings do not pay for it.
    assert not allowance.allows_terminal(MS, distinct=False)
    # Decode earnings never pay for anchor extras.
    assert not allowance.allows_extra(MS)


def test_queue_23_terminal_capture_may_spend_the_prefill_remainder() -> None:
    allowance = CheckpointAllowance(0.05, prefill_work_ns=20 * MS)  # 1 ms prefill part
    allowance.earn_decode(40 * MS)  # 2 ms decode part
    allowance.charge(MS // 2)  # an anchor copy spent half the prefill part
    assert allowance.terminal_room_ns(distinct=True) == MS // 2 + 2 * MS
    assert allowance.take_terminal(MS // 2 + 2 * MS, distinct=True)
    assert not allowance.take_terminal(1, distinct=True)
    # Unknown terminal cost: no capture, nothing charged (QUEUE-22).
    fresh = CheckpointAllowance(0.05, prefill_work_ns=20 * MS)
    fresh.earn_decode(100 * MS)
    assert not fresh.take_terminal(None, distinct=True)
    assert not fresh.take_terminal(0, distinct=True)
    assert fresh.spent_ns == 0


def test_queue_24_no_capture_count_and_no_concurrency_share() -> None:
    """Captures scale with the allowance only: many small ones while they fit, and a
    request's room does not depend on any other request's."""
    one = CheckpointAllowance(0.05, prefill_work_ns=200 * MS)  # 10 ms of room
    other = CheckpointAllowance(0.05, prefill_work_ns=200 * MS)
    planned = 0
    while plan_capture(one, split_ns=0, copy_ns=MS // 4, destination_obtainable=True):
        planned += 1
    assert planned == 40
    assert other.extra_room_ns() == 10 * MS  # untouched by the first request's captures


def test_queue_25_no_destination_no_extra_cut() -> None:
    allowance = CheckpointAllowance(0.05, prefill_work_ns=200 * MS)
    assert plan_capture(allowance, split_ns=MS, copy_ns=MS,
                        destination_obtainable=False) is None
    assert allowance.spent_ns == 0


def test_queue_26_an_expired_copy_is_skipped_after_its_split_ran() -> None:
    allowance = CheckpointAllowance(0.05, prefill_work_ns=200 * MS)
    planned = plan_capture(allowance, split_ns=3 * MS, copy_ns=2 * MS,
                           destination_obtainable=True)
    assert planned is not None and allowance.spent_ns == 5 * MS
    # The copy's estimate went stale between the split and the copy: skipped, its
    # charge refunded, the executed split's charge kept.
    assert not copy_after_split(allowance, planned, current_copy_ns=None)
    assert allowance.spent_ns == 3 * MS
    again = plan_capture(allowance, split_ns=0, copy_ns=2 * MS, destination_obtainable=True)
    assert again is not None
    assert copy_after_split(allowance, again, current_copy_ns=2 * MS)
    assert allowance.spent_ns == 5 * MS


def test_ledger_refuses_invalid_values() -> None:
    with pytest.raises(ValueError, match="fraction"):
        CheckpointAllowance(float("nan"))
    allowance = CheckpointAllowance(0.05)
    with pytest.raises(ValueError, match="non-negative"):
        allowance.charge(-1)
    with pytest.raises(ValueError, match="refund"):
        allowance.refund(1)


def test_zero_fraction_allows_nothing() -> None:
    allowance = CheckpointAllowance(0.0, prefill_work_ns=10**12)
    allowance.earn_decode(10**12)
    assert not allowance.allows_extra(1)
    assert not allowance.allows_terminal(1, distinct=True)
