"""Two-stage lookahead, continuation index and terminal values (seed: *Prerequisites and
completion*), checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
from selection_setup import make_decoder
from synthetic_catalog import MS, decode, duration_ns, measured_scheduler, snapshot

from policy import LaneRole, Phase
from policy.prerequisites import (
    best_pair_cohort,
    continuation_index,
    multistage_rate,
    sequence_rate,
    terminal_lane_value,
)


def brute_force(bp: int, bf: int, new: list[float], ready: list[float],
                term: list[float]) -> float | None:
    best = None
    for k in range(1, len(new) + 1):
        for chosen_new in itertools.combinations(new, k):
            for r in range(len(ready) + 1):
                for chosen_ready in itertools.combinations(ready, r):
                    for t in range(len(term) + 1):
                        for chosen_term in itertools.combinations(term, t):
                            if k + t > bp or k + r > bf:
                                continue
                            v = sum(chosen_new) + sum(chosen_ready) + sum(chosen_term)
                            best = v if best is None else max(best, v)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_pre_7_8_9_pair_cohort_equals_brute_force(seed: int) -> None:
    """Covers PRE-3, PRE-6, PRE-7, PRE-8, PRE-9, PRE-10."""
    rng = random.Random(seed)
    new = [rng.uniform(0, 10) for _ in range(rng.randint(0, 4))]
    ready = [rng.uniform(0, 10) for _ in range(rng.randint(0, 4))]
    term = [rng.uniform(0, 10) for _ in range(rng.randint(0, 3))]
    bp, bf = rng.randint(1, 4), rng.randint(1, 4)
    choice = best_pair_cohort(prerequisite_capacity=bp, following_capacity=bf,
                              newly_ready=new, ready=ready, terminal=term)
    expected = brute_force(bp, bf, new, ready, term)
    if expected is None:
        assert choice is None  # PRE-10: at least one newly ready row
    else:
        assert choice is not None and choice.newly_ready >= 1
        assert choice.value == pytest.approx(expected)
        assert choice.newly_ready + choice.terminal <= bp
        assert choice.newly_ready + choice.ready <= bf


def test_pre_16_equal_value_prefers_advancing_more_rows() -> None:
    """Covers PRE-16, OPEN-19: zero-valued extra rows still ride along."""
    choice = best_pair_cohort(prerequisite_capacity=4, following_capacity=4,
                              newly_ready=[5.0, 0.0], ready=[], terminal=[0.0])
    assert choice is not None and (choice.newly_ready, choice.terminal) == (2, 1)


def test_pre_21_continuation_index() -> None:
    """Covers PRE-21, PRE-22, PRE-24: V=100, T=10, F=30 -> 25; unknown F -> V."""
    assert continuation_index(100.0, 10.0, 30.0) == pytest.approx(25.0)
    assert continuation_index(100.0, 10.0, 0.0) == 100.0
    assert multistage_rate([25.0, 15.0], 10.0, 0.2) == pytest.approx(40 / 10 - 5 * 0.2)


def test_pre_11_13_sequence_score() -> None:
    """Covers PRE-11, PRE-13, PRE-46: a terminal retired at T stops waiting there."""
    both = sequence_rate(value=120.0, first_ms=10.0, following_ms=30.0, waiting=0.5)
    retired = sequence_rate(value=120.0, first_ms=10.0, following_ms=30.0, waiting=0.4,
                            first_stage_waiting=0.1)
    assert both == pytest.approx(120 / 40 - 20 * 0.5)
    assert retired == pytest.approx(120 / 40 - 20 * 0.4 - 0.1 * 100 / 2 / 40)
    assert retired > both


def test_pre_44_terminal_lane_value() -> None:
    """Covers PRE-44, PRE-50: defaults 256 + 1*sigma*(A+T); no sigma, no age term."""
    assert terminal_lane_value(terminal_value=256, terminal_age_price=1, sigma_ms=2.0,
                               age_ms=3.0, duration_ms=1.0) == 264.0
    assert terminal_lane_value(terminal_value=256, terminal_age_price=1, sigma_ms=None,
                               age_ms=3.0, duration_ms=1.0) == 256.0


def test_ver_27_snapshot_cost_decides_whether_shared_decode_batch_wins() -> None:
    """Covers VER-27, PRE-2, PRE-5, PRE-11, PRE-12: a prerequisite state operation (cost
    T) enables one more stream to join a shared decode batch (cost F). The sequence
    beats decoding the ready stream alone only while T is small enough."""
    f_ms, waiting = 8.2, 0.2
    ready_value, new_value = 150.0, 150.0

    def sequence_wins(t_ms: float) -> bool:
        choice = best_pair_cohort(prerequisite_capacity=1, following_capacity=2,
                                  newly_ready=[new_value], ready=[ready_value], terminal=[])
        assert choice is not None and (choice.newly_ready, choice.ready) == (1, 1)
        seq = sequence_rate(value=choice.value, first_ms=t_ms, following_ms=f_ms,
                            waiting=waiting)
        alone = ready_value / f_ms - f_ms / 2 * waiting
        return seq > alone

    outcomes = [sequence_wins(t) for t in (0.5, 2.0, 5.0, 8.0, 12.0, 20.0)]
    assert outcomes[0] and not outcomes[-1]
    flip = outcomes.index(False)
    assert all(outcomes[:flip]) and not any(outcomes[flip:])  # one threshold


def test_pre_45_pending_terminal_enters_every_waiting_cost() -> None:
    """Covers PRE-45, PRE-48: a pending terminal lowers a decode score by
    T/2*terminal_age_price and a cheap snapshot competes through the same score."""
    s = measured_scheduler((decode(1), snapshot(1)))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    base = s.plan()
    assert base is not None and base.shape == decode(1)
    rate_before = base.selection_value_rate() * 2.0 ** base.scale_exponent
    t = s.admit(prompt_len=64, max_output_tokens=4)
    rec = s.request(t)
    rec.phase, rec.prompt_cursor, rec.terminal_since_ns = Phase.TERMINAL, 64, s.now_ns
    s.set_catalog((decode(1),))  # only the decode competes; the terminal just waits
    with_terminal = s.plan()
    assert with_terminal is not None
    rate_after = with_terminal.selection_value_rate() * 2.0 ** with_terminal.scale_exponent
    t_ms = duration_ns(decode(1)) / MS
    assert rate_before - rate_after == pytest.approx(t_ms / 2 * s.config.terminal_age_price)
    s.set_catalog((decode(1), snapshot(1)))
    plan = s.plan()
    assert plan is not None and plan.lanes[0].role is LaneRole.TERMINAL  # 256 in 1.2 ms
