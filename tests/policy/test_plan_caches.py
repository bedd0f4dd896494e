"""The caches that keep ``plan()`` fast never change an answer (docs/benchmarks-plan.md).

``ShapeTimes.stale_at`` reuses one stale mask while no shape crosses its freshness
boundary and patches it when an estimate changes (DUR-10, OPEN-11); request records
remember their prompt boundaries per cursor (SEL-40, DUR-20); memos keyed by request
lengths stay bounded over the life of the process.
"""

from __future__ import annotations

import random

import numpy as np
from selection_setup import make_decoder
from synthetic_catalog import MS, decode, measured_scheduler, prefill, records_for

from policy import ExecutionTiming, Fence, Scheduler
from policy.prerequisites import MEMO_LIMIT, _remember
from policy.selection import ShapeTimes


def test_dur_10_cached_stale_mask_equals_the_rule_under_updates() -> None:
    """Covers DUR-10, OPEN-11: over random clocks (forward and backward), freshness
    intervals and estimate updates (one shape's or all at once), the cached mask always
    equals a fresh evaluation of ``known and now - last_valid >= ttl``."""
    rng = random.Random(5)
    n = 12
    grid = 10 * MS  # a coarse clock: boundaries often coincide (the inclusive edge)
    times = ShapeTimes(
        estimate_ns=np.array([rng.choice([0, 5 * MS]) for _ in range(n)], dtype=np.int64),
        last_valid_ns=np.array([rng.choice([-1, rng.randint(0, 10) * grid])
                                for _ in range(n)], dtype=np.int64),
        last_touched_ns=np.zeros(n, dtype=np.int64))
    now = 5 * grid
    for _ in range(3000):
        roll = rng.random()
        if roll < 0.3:
            i = rng.randrange(n)
            times.update(i, rng.choice([0, 4 * MS, 6 * MS]),
                         rng.choice([-1, now, now - rng.randint(0, 8) * grid]), now)
        elif roll < 0.4:  # a shared speed factor moved every estimate (policy.cost_drift)
            times.set_estimates([rng.choice([0, 4 * MS, 6 * MS]) for _ in range(n)])
        elif roll < 0.9:
            now += rng.randint(0, 2) * grid
        else:
            now = max(0, now - rng.randint(0, 3) * grid)
        ttl = rng.choice([4 * grid, 4 * grid, 4 * grid, 2 * grid])
        assert times.stale_at(now, ttl).tolist() == times.stale(now, ttl).tolist()


def test_sel_40_remembered_prompt_boundaries_follow_the_cursor() -> None:
    """Covers SEL-40, DUR-20: after each prefill chunk the remembered logical end and
    next endpoint equal a fresh computation."""
    s = Scheduler(catalog=(prefill(64),))
    h = s.admit(prompt_len=300, max_output_tokens=4, message_ends=(10, 100, 250),
                system_end=120)
    rec = s.request(h)
    for cursor in (0, 10, 64, 120, 128, 250, 299):
        rec.prompt_cursor = cursor
        assert rec.prompt_ends() == (rec.logical_prompt_end(), rec.next_endpoint())


def test_memo_keyed_by_request_lengths_stays_bounded() -> None:
    """A memo keyed by remaining-token counts never holds more than ``MEMO_LIMIT``
    entries, whatever lengths a long-running server sees."""
    memo: dict[int, int] = {}
    for length in range(3 * MEMO_LIMIT):
        _remember(memo, length, length)
        assert len(memo) <= MEMO_LIMIT
    assert memo[3 * MEMO_LIMIT - 1] == 3 * MEMO_LIMIT - 1


def test_dur_8_estimate_change_reaches_the_next_decision() -> None:
    """Covers DUR-8, DUR-9: a completion that moves a median changes the durations the
    next decision ranks with (the per-family cache is dropped in place)."""
    from policy.candidate_families import DECODE, family_shapes, family_times

    s = measured_scheduler((decode(1),))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=5.0)
    times = s._shape_times()
    shapes = family_shapes(s._catalog, DECODE).shapes
    before = family_times(times, DECODE, shapes).est[0]
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    slow = 3 * before
    s.advance_to(s.now_ns + slow)
    s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(slow,),
                                                            wall_ns=slow))
    after = s._estimates.estimate_ns(decode(1))  # not the property: it drops the cache
    assert after != before
    assert s._shape_times() is times  # updated in place, not rebuilt
    assert family_times(times, DECODE, shapes).est == [after]
