"""Property tests: random admission, cancellation, completion and time sequences never
produce a plan that exceeds a capacity, names a cancelled or stale-epoch request, or
carries a non-finite score; prices stay finite."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_catalog import MS, duration_ns, measured_scheduler, ordinary_catalog

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    LaneRole,
    Phase,
    RestoreNeed,
    ScheduledPlan,
    Scheduler,
    StateOp,
)
from policy.service import delivery_price, output_token_price, prefill_token_price

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 9000), st.integers(1, 40),
                  st.integers(0, 100), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.booleans(), st.booleans()),
        st.tuples(st.just("wait"), st.integers(0, 40_000)),
    ),
    min_size=1, max_size=60,
)


def _durations(shape: GraphShape) -> int:
    if shape.state_op is StateOp.RESTORE:
        return MS + shape.batch_capacity * MS // 5
    return duration_ns(shape)


def check_plan(s: Scheduler, plan: ScheduledPlan) -> None:
    shape = plan.shape
    assert 1 <= len(plan.lanes) <= min(shape.batch_capacity, 64)
    assert math.isfinite(plan.selection_value_rate())
    assert len(set(plan.handles())) == len(plan.lanes)
    for lane in plan.lanes:
        rec = s.request(lane.handle)
        assert not rec.cancelled and rec.phase is not Phase.RETIRED
        assert rec.epoch == lane.epoch
        assert (lane.role is LaneRole.RESTORE) == (rec.restore is RestoreNeed.READY)
        if lane.role is LaneRole.PROMPT:
            cap = (shape.prefill_capacity if shape.kind is GraphKind.MIXED
                   else shape.token_capacity)
            assert 1 <= lane.prompt_tokens <= cap
            assert lane.prompt_start + lane.prompt_tokens <= rec.prompt_len
    if plan.step.mixed is not None:
        prompts = [i for i, lane in enumerate(plan.lanes) if lane.role is LaneRole.PROMPT]
        assert prompts == ([plan.step.mixed.prefill_row] if prompts else [])
        assert plan.step.mixed.prefill_row in (-1, 0)


@settings(deadline=None, max_examples=60)
@given(ops)
def test_plans_respect_capacities_epochs_and_cancellation(script: list[tuple]) -> None:
    """Covers SEL-31, QUEUE-8, QUEUE-6, SEL-20, MIX-9, PRE-32: invariants under random
    traffic, including restore prerequisites."""
    restore_shapes = tuple(GraphShape(kind=GraphKind.STATE, batch_capacity=b,
                                      token_capacity=1, state_op=StateOp.RESTORE)
                           for b in (1, 4))
    s = measured_scheduler(ordinary_catalog(with_mixed=True, with_snapshot=True)
                           + restore_shapes, durations=_durations)
    fence = 0
    in_flight: list[tuple[int, ScheduledPlan]] = []
    handles: list = []
    for op in script:
        if op[0] == "admit":
            _, prompt_len, max_out, cached, needs_restore = op
            handles.append(s.admit(
                prompt_len=prompt_len, max_output_tokens=max_out,
                cached_prefix_len=min(cached, prompt_len - 1),
                restore=RestoreNeed.READY if needs_restore else RestoreNeed.NONE))
        elif op[0] == "cancel" and handles:
            h = handles[op[1] % len(handles)]
            if h in s.handles():
                s.cancel(h)
        elif op[0] == "step":
            _, malformed, queue_more = op
            plan = s.plan()
            if plan is not None:
                check_plan(s, plan)
                if s.window_ready(plan):
                    fence += 1
                    s.commit(plan, Fence(fence))
                    in_flight.append((fence, plan))
            if in_flight and not (queue_more and len(in_flight) == 1):
                f, done = in_flight.pop(0)
                d = _durations(done.shape)
                s.advance_to(s.now_ns + d)
                recs = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                         prompt_tokens=lane.prompt_tokens,
                                         token_ids=(3,) * lane.token_ceiling,
                                         ok=not (malformed and i == 0))
                        for i, lane in enumerate(done.lanes)]
                for g in s.complete(Fence(f), recs,
                                    ExecutionTiming(device_intervals_ns=(d,), wall_ns=d)):
                    if g.token_ids:
                        s.published_output(g.handle, g.fence, s.now_ns)
                s.take_released()
        elif op[0] == "wait":
            s.advance_to(s.now_ns + op[1] * MS // 100)
        for h in s.handles():
            hist = s.request(h).history
            for price in (prefill_token_price(hist, s.config),
                          output_token_price(hist, s.config), delivery_price(hist, s.config)):
                assert math.isfinite(price) and price > 0
