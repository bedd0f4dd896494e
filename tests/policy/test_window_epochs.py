"""A restore inside another frame binds a fresh request generation (``renew_epoch`` and
``with_epoch``, ``policy.residency``), in the seed's ``Scheduler`` and a baseline.

A 100-token prompt with two one-image windows (images at 10..30 and 50..70): its first
chunk stops before the second window, so the second chunk is the window boundary whose
frame restores the request's row from its window snapshot (docs/vision.md).

Covers PRE-32 (the epoch increments at the restore; a plan or completion of the old
epoch is rejected), PRE-31 (no renewal while a frame of the request is in flight) and
PRE-34 (the renewed request is the same request: its cursor and output continue).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    ImagePlan,
    LaneRole,
    Phase,
    PolicyError,
    RequestHandle,
    ScheduledPlan,
    Scheduler,
    StaleEpochError,
    with_epoch,
)
from policy.baselines import FcfsPolicy
from policy.protocol import SchedulingPolicy

MS = 1_000_000
CATALOG = (
    GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64),
    GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=128),
    GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1, packed_capacity=1),
)
IMAGES = ImagePlan(spans=((10, 30), (50, 70)), window_images=1, atomic_capacity=64)
TIMING = ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS)


def _scheduler() -> SchedulingPolicy:
    s = Scheduler(None, CATALOG)
    for shape in CATALOG:
        s.estimates.observe(shape, MS, 1)
    s.advance_to(1)
    return s


def _fcfs() -> SchedulingPolicy:
    return FcfsPolicy(catalog=CATALOG)


POLICIES = pytest.mark.parametrize("make", [_scheduler, _fcfs], ids=["seed", "fcfs"])


def _records(plan: ScheduledPlan, epoch: int | None = None) -> list[CompletionRecord]:
    """A valid completion of every lane; ``epoch``: the one it reports (the lane's)."""
    return [CompletionRecord(handle=lane.handle,
                             epoch=lane.epoch if epoch is None else epoch,
                             prompt_tokens=lane.prompt_tokens,
                             token_ids=(7,) * lane.token_ceiling)
            for lane in plan.lanes]


def _run(p: SchedulingPolicy, plan: ScheduledPlan, fence: int,
         records: list[CompletionRecord] | None = None) -> None:
    p.commit(plan, Fence(fence))
    p.advance_to(p.now_ns + MS)
    p.complete(Fence(fence), _records(plan) if records is None else records, TIMING)


def _at_boundary(make: Callable[[], SchedulingPolicy]
                 ) -> tuple[SchedulingPolicy, RequestHandle, ScheduledPlan]:
    """A policy whose request has run its first window; the plan of its boundary chunk."""
    p = make()
    h = p.admit(prompt_len=100, max_output_tokens=4, images=IMAGES)
    first = p.plan()
    assert first is not None and first.lanes[0].prompt_tokens == 50
    _run(p, first, 1)
    boundary = p.plan()
    assert boundary is not None
    assert [(lane.role, lane.prompt_start) for lane in boundary.lanes] == [
        (LaneRole.PROMPT, 50)]
    return p, h, boundary


@POLICIES
def test_pre_32_a_renewed_request_runs_its_boundary_frame_in_the_new_epoch(
        make: Callable[[], SchedulingPolicy]) -> None:
    """Covers PRE-32, PRE-34: ``renew_epoch`` increments the request's epoch; the plan
    made before it no longer commits (its lane carries the old epoch), the rebound plan
    does, and the request continues as the same request: its prompt ends and it
    decodes and finishes in the new epoch."""
    p, h, boundary = _at_boundary(make)
    old = p.request(h).epoch
    epoch = p.renew_epoch(h)
    assert epoch == old + 1 and p.request(h).epoch == epoch
    with pytest.raises(StaleEpochError):
        p.commit(boundary, Fence(2))
    rebound = with_epoch(boundary, h, epoch)
    assert [lane.epoch for lane in rebound.lanes] == [epoch]
    assert rebound.lanes[0]._replace(epoch=old) == boundary.lanes[0]
    _run(p, rebound, 2)
    assert p.phase(h) is Phase.DECODE
    for fence in range(3, 7):
        plan = p.plan()
        if plan is None:
            break
        assert {lane.epoch for lane in plan.lanes} == {epoch}
        _run(p, plan, fence)
    assert p.phase(h) is Phase.RETIRED and p.take_released() == [h]


@POLICIES
def test_pre_32_a_completion_of_the_old_epoch_is_rejected(
        make: Callable[[], SchedulingPolicy]) -> None:
    """Covers PRE-32: the boundary frame, committed in the new epoch, completing with a
    record of the old epoch applies nothing: no prompt progress and no output; the
    lane fails."""
    p, h, boundary = _at_boundary(make)
    old = p.request(h).epoch
    epoch = p.renew_epoch(h)
    rebound = with_epoch(boundary, h, epoch)
    p.commit(rebound, Fence(2))
    p.advance_to(p.now_ns + MS)
    out = p.complete(Fence(2), _records(rebound, epoch=old), TIMING)
    assert p.request(h).prompt_cursor == 50 and p.request(h).output_committed == 0
    assert all(not t.token_ids for t in out)
    assert p.statistics().failed_lanes == 1


@POLICIES
def test_pre_31_no_renewal_while_a_frame_of_the_request_is_in_flight(
        make: Callable[[], SchedulingPolicy]) -> None:
    """Covers PRE-31, PRE-32: a frame in flight would complete in a stale epoch, so the
    renewal is refused then (the epoch stays), and allowed once it completed."""
    p, h, boundary = _at_boundary(make)
    old = p.request(h).epoch
    p.commit(boundary, Fence(2))
    with pytest.raises(PolicyError, match="in flight"):
        p.renew_epoch(h)
    assert p.request(h).epoch == old
    p.advance_to(p.now_ns + MS)
    p.complete(Fence(2), _records(boundary), TIMING)
    assert p.renew_epoch(h) == old + 1
