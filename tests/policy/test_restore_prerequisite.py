"""Restore prerequisites through the production scheduler: (restore, inference) pair
candidates, joint cohorts, fresh generations and snapshot-cost variation."""

from __future__ import annotations

import pytest
from selection_setup import make_decoder
from synthetic_catalog import MS, decode, duration_ns, measured_scheduler, prefill, records_for

from policy import (
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    LaneRole,
    Phase,
    RestoreNeed,
    Scheduler,
    StateOp,
)


def restore(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                      state_op=StateOp.RESTORE)


def restorable_decoder(s: Scheduler, need: RestoreNeed = RestoreNeed.READY) -> int:
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=20.0)
    s.request(h).restore = need
    return h


def durations(restore_ms: float) -> dict[GraphShape, int]:
    return {decode(1): duration_ns(decode(1)), decode(2): duration_ns(decode(2)),
            restore(1): round(restore_ms * MS), restore(2): round(restore_ms * 1.2 * MS)}


def test_pre_1_2_17_19_restore_pair_plan_then_fresh_generation() -> None:
    """Covers PRE-1, PRE-2, PRE-5, PRE-17, PRE-19, PRE-20, PRE-32: a cheap restore
    enabling a shared decode batch is planned as the restore alone, with its own
    duration; completion binds a fresh epoch and the request then decodes."""
    cat = durations(1.0)
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    ready = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=20.0)
    blocked = restorable_decoder(s)
    plan = s.plan()
    assert plan is not None and plan.shape.state_op is StateOp.RESTORE
    assert [lane.role for lane in plan.lanes] == [LaneRole.RESTORE]
    assert plan.handles() == (blocked,) and plan.lookahead_shape == decode(2)
    assert plan.estimated_duration_ns == cat[plan.shape] and plan.requires_empty_window
    old_epoch = s.request(blocked).epoch
    s.commit(plan, Fence(1))
    s.advance_to(s.now_ns + cat[plan.shape])
    out = s.complete(Fence(1), records_for(plan), ExecutionTiming(
        device_intervals_ns=(cat[plan.shape],), wall_ns=cat[plan.shape]))
    assert out == []  # setup earns no tokens
    rec = s.request(blocked)
    assert rec.epoch == old_epoch + 1 and rec.restore is RestoreNeed.NONE
    following = s.plan()  # replanned, not auto-submitted
    assert following is not None and set(following.handles()) == {ready, blocked}


def test_ver_27_restore_cost_decides_whether_shared_batch_wins() -> None:
    """Covers VER-27, PRE-11, PRE-3: as the prerequisite's cost grows, the sequence
    (restore, then a shared decode batch) stops beating decoding the ready stream."""
    outcomes = []
    for restore_ms in (0.5, 2.0, 8.0, 30.0, 120.0):
        cat = durations(restore_ms)
        s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=20.0)
        restorable_decoder(s)
        plan = s.plan()
        assert plan is not None
        outcomes.append(plan.shape.state_op is StateOp.RESTORE)
    assert outcomes[0] and not outcomes[-1]
    flip = outcomes.index(False)
    assert all(outcomes[:flip]) and not any(outcomes[flip:])


def test_acct_4_awaiting_restoration_is_outside_participants() -> None:
    """Covers ACCT-4: a request awaiting external restoration is neither planned nor
    charged; once restoration is ready a restore graph can serve it."""
    cat = durations(1.0)
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    waiting = restorable_decoder(s, RestoreNeed.AWAITING)
    plan = s.plan()
    assert plan is not None and waiting not in plan.handles()
    rate = s.request(waiting).history.token_rate
    s.commit(plan, Fence(1))
    d = cat[plan.shape]
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(d,),
                                                            wall_ns=d))
    assert s.request(waiting).history.token_rate == rate
    s.restoration_ready(waiting)
    assert s.request(waiting).restorable


def test_pre_24_unknown_restore_ranks_by_useful_value() -> None:
    """Covers PRE-24, PRE-50, DUR-22: an unmeasured restore graph is discovered first."""
    cat = durations(1.0)
    s = Scheduler(catalog=(*cat, prefill(64)))
    for shape in (decode(1), decode(2)):
        s.estimates.observe(shape, cat[shape], 1)
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    blocked = restorable_decoder(s)
    plan = s.plan()
    assert plan is not None and plan.shape.state_op is StateOp.RESTORE
    assert not plan.duration_known and plan.handles() == (blocked,)
    assert s.phase(blocked) is Phase.DECODE


@pytest.mark.parametrize("cap", [1, 2])
def test_pre_15_spare_restore_rows_advance_more_requests(cap: int) -> None:
    """Covers PRE-15: a restore graph fills its spare rows with more restorable rows."""
    cat = {decode(1): duration_ns(decode(1)), restore(cap): MS}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    blocked = {restorable_decoder(s) for _ in range(2)}
    plan = s.plan()
    assert plan is not None and plan.shape == restore(cap)
    assert len(plan.lanes) == cap and set(plan.handles()) <= blocked


@pytest.mark.parametrize("seed", range(8))
def test_pre_9_scheduler_pair_value_equals_pair_cohort_optimum(seed: int) -> None:
    """Covers PRE-7, PRE-9, PRE-12: the scheduler's vectorised pair value for the chosen
    shapes equals ``best_pair_cohort`` on the same lane values."""
    import random

    from policy.decision import build_context
    from policy.prerequisites import best_pair_cohort, best_prerequisite

    rng = random.Random(seed)
    cat = {decode(1): duration_ns(decode(1)), decode(2): duration_ns(decode(2)),
           decode(4): duration_ns(decode(4)), restore(1): MS, restore(2): 2 * MS}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    for _ in range(rng.randint(0, 4)):
        make_decoder(s, token_rate=rng.uniform(0.1, 5), delivery_rate=rng.uniform(0.1, 2),
                     age_ms=rng.uniform(0, 50))
    for _ in range(rng.randint(1, 3)):
        h = make_decoder(s, token_rate=rng.uniform(0.1, 5), delivery_rate=rng.uniform(0.1, 2),
                         age_ms=rng.uniform(0, 50))
        s.request(h).restore = RestoreNeed.READY
    ctx = build_context(records={h: s.request(h) for h in s.handles()},
                        catalog=s._catalog, times=s._shape_times(), config=s.config,
                        queue=s._queue, now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns,
                        refresh_funded=False)
    choice = best_prerequisite(ctx)
    assert choice is not None and choice.following_shape is not None
    span = (ctx.estimate_ns[choice.shape] + ctx.estimate_ns[choice.following_shape]) / MS
    group = ctx.restorable
    newly = [b + group.slope * span for b, d in zip(group.base, group.decoding, strict=True)
             if d]
    ready = [float(b) + ctx.decoders.slope * span for b in ctx.decoders.base]
    exact = best_pair_cohort(
        prerequisite_capacity=int(ctx.catalog.batch[choice.shape]),
        following_capacity=int(ctx.catalog.batch[choice.following_shape]),
        newly_ready=newly, ready=ready, terminal=[])
    assert exact is not None and choice.value == pytest.approx(exact.value, rel=1e-12)
