"""Service accounting through the scheduler: intervals for queued and isolated frames,
committed-counter differences across queued frames, frozen plans and normalisers, and
mixed shapes in the reference interval and dominance."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from selection_setup import make_decoder, make_prompt
from synthetic_catalog import MS, decode, measured_scheduler, mixed, records_for

from policy import ExecutionTiming, Fence, GraphKind
from policy.selection import _dominated_by_smaller


def test_acct_7_9_10_queued_frames_use_device_interval_and_own_delta() -> None:
    """Covers ACCT-7, ACCT-8, ACCT-9, ACCT-10, ACCT-2: the isolated first frame is charged
    over max(device, wall); the queued second over its device interval; each frame adds
    only its own committed token."""
    s = measured_scheduler((decode(1),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    second = s.plan()
    assert second is not None and s.window_ready(second)
    s.commit(second, Fence(2))
    frames = list(s._queue)
    assert frames[0].isolated and not frames[1].isolated
    assert frames[0].normalizers.token_rate_per_ms > 0  # recorded at commit
    x0 = s.request(h).history.token_rate
    decay = lambda ms: math.exp(-ms / s.config.adaptation_ms)  # noqa: E731
    s.advance_to(s.now_ns + 20 * MS)
    s.complete(Fence(1), records_for(first),
               ExecutionTiming(device_intervals_ns=(8 * MS,), wall_ns=20 * MS))
    x1 = x0 * decay(20) + (1 / 20) * (1 - decay(20))  # isolated: wall 20 ms
    assert s.request(h).history.token_rate == pytest.approx(x1)
    s.advance_to(s.now_ns + 20 * MS)
    s.complete(Fence(2), records_for(second),
               ExecutionTiming(device_intervals_ns=(8 * MS,), wall_ns=20 * MS))
    x2 = x1 * decay(8) + (1 / 8) * (1 - decay(8))  # queued: device 8 ms, one token
    assert s.request(h).history.token_rate == pytest.approx(x2)
    assert s.request(h).output_committed == 3


def test_queue_5_plan_is_frozen() -> None:
    """Covers QUEUE-5: later price changes leave a plan's score unchanged."""
    s = measured_scheduler((decode(1),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    plan = s.plan()
    assert plan is not None
    score = plan.selection_value_rate()
    s.request(h).history.token_rate = 0.001
    assert plan.selection_value_rate() == score
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scaled_score = 0.0  # type: ignore[misc]


def test_mix_23_sigma_can_come_from_a_mixed_shape() -> None:
    """Covers MIX-23, SEL-16: with only a mixed shape measured, decoders still get a
    reference interval, so their age raises the plan's score."""
    s = measured_scheduler((mixed(2, 64),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    young = s.plan()
    s.request(h).last_visible_ns -= 100 * MS
    old = s.plan()
    assert young is not None and old is not None
    assert old.shape.kind is GraphKind.MIXED
    assert old.selection_value_rate() > young.selection_value_rate()


def test_sel_33_mixed_dominance_needs_same_prompt_row_and_work() -> None:
    """Covers SEL-33: rows with different prompt work are both kept; with the same work
    the larger capacities are dropped."""
    keys = np.array([[0, 64, 1], [0, 64, 1], [0, 200, 1]])
    batch = np.array([2, 4, 4])
    prompt = np.array([64, 64, 256])
    assert _dominated_by_smaller(keys, batch, prompt).tolist() == [False, True, False]


def test_pre_18_lookahead_time_never_enters_cost_learning() -> None:
    """Covers PRE-17, PRE-18: a restore's completion updates only its own estimate with
    its own interval."""
    from test_restore_prerequisite import durations, restorable_decoder

    cat = durations(1.0)
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=20.0)
    restorable_decoder(s)
    plan = s.plan()
    assert plan is not None and plan.lookahead_shape is not None
    following_before = s.estimates.samples(plan.lookahead_shape)
    s.commit(plan, Fence(1))
    s.advance_to(s.now_ns + 3 * MS)
    s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(3 * MS,),
                                                            wall_ns=3 * MS))
    assert s.estimates.samples(plan.shape)[-1] == 3 * MS
    assert s.estimates.samples(plan.lookahead_shape) == following_before


def test_sel_38_plan_cost_does_not_explode_with_requests() -> None:
    """Covers SEL-38, SEL-30 (by construction): 64 decoders and 64 prompts produce a
    candidate table linear in requests x shapes, never subsets."""
    from selection_reference import _mixed_candidates, _prefill_candidates, _Table

    from policy.decision import build_context

    s = measured_scheduler((decode(64), mixed(64, 256), mixed(2, 64)))
    for i in range(64):
        make_decoder(s, token_rate=1.0 + i, delivery_rate=1.0, age_ms=float(i))
        make_prompt(s, prompt_len=100 + i, token_rate=1.0)
    ctx = build_context(records={h: s.request(h) for h in s.handles()}, catalog=s._catalog,
                        times=s._shape_times(), config=s.config, queue=s._queue,
                        now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns, refresh_funded=False)
    table = _Table.empty()
    _mixed_candidates(table, ctx)
    _prefill_candidates(table, ctx, ctx.catalog.prefill, scored=False)
    assert len(table.cat("shape")) <= 2 * len(ctx.catalog.mixed)
    plan = s.plan()
    assert plan is not None and len(plan.lanes) <= 64
