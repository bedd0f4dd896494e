"""``fcfs``: arrival order, whole prompts first, running slots like ``max_num_seqs``.

Covers the baseline ``fcfs`` and the shared baseline lifecycle: commit rechecks
(QUEUE-6, QUEUE-7), the two-slot window (QUEUE-10, QUEUE-11, QUEUE-12), lane validation before any
update (ACCT-6) and terminal snapshots before release (PRE-41).
"""

from __future__ import annotations

import pytest

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    FinishKind,
    GraphKind,
    GraphShape,
    LaneRole,
    Phase,
    RequestHandle,
    ScheduledPlan,
    StaleEpochError,
    WindowNotReady,
)
from policy.baselines import FcfsPolicy
from policy.descriptors import StateOp
from policy.protocol import SchedulingPolicy

MS = 1_000_000


def prefill(c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)


def decode(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                      packed_capacity=b)


SNAPSHOT = GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0,
                      state_op=StateOp.SNAPSHOT)
CATALOG = (prefill(64), prefill(256), prefill(1024), decode(1), decode(2), decode(4))


class Driver:
    """Runs a policy frame by frame with hand-made completions."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.p = policy
        self.fence = 0
        self.now = 0
        self.plans: list[ScheduledPlan] = []

    def step(self) -> ScheduledPlan:
        plan = self.p.plan()
        assert plan is not None
        self.fence += 1
        self.p.commit(plan, Fence(self.fence))
        self.plans.append(plan)
        self.now += MS
        self.p.advance_to(self.now)
        self.p.complete(Fence(self.fence), [
            CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                             token_ids=(1,) * lane.token_ceiling,
                             prompt_tokens=lane.prompt_tokens)
            for lane in plan.lanes], ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
        return plan


def test_fcfs_prefills_whole_prompts_in_arrival_order_then_decodes() -> None:
    """1500 tokens: one 1024 chunk, then the rest (476) on the smallest capacity that
    holds it; the next prompt only after the first is whole; decode after all prompts."""
    p = FcfsPolicy(catalog=CATALOG)
    a = p.admit(prompt_len=1500, max_output_tokens=4)
    b = p.admit(prompt_len=100, max_output_tokens=4)
    c = p.admit(prompt_len=30, max_output_tokens=4)
    d = Driver(p)
    seen = [(pl.lanes[0].handle, pl.lanes[0].prompt_tokens, pl.shape.token_capacity)
            for pl in (d.step() for _ in range(4))]
    assert seen == [(a, 1024, 1024), (a, 476, 1024), (b, 100, 256), (c, 30, 64)]
    plan = d.step()
    assert plan.shape == decode(4)
    assert [lane.handle for lane in plan.lanes] == [a, b, c]


def test_fcfs_prefill_comes_before_waiting_decoders() -> None:
    p = FcfsPolicy(catalog=CATALOG)
    a = p.admit(prompt_len=10, max_output_tokens=8)
    d = Driver(p)
    d.step()
    assert p.phase(a) is Phase.DECODE
    b = p.admit(prompt_len=10, max_output_tokens=8)
    plan = d.step()
    assert plan.shape.kind is GraphKind.PREFILL and plan.lanes[0].handle == b


def test_fcfs_starts_no_more_requests_than_the_largest_decode_batch() -> None:
    p = FcfsPolicy(catalog=(prefill(64), decode(1), decode(2)))
    hs = [p.admit(prompt_len=10, max_output_tokens=2) for _ in range(3)]
    d = Driver(p)
    assert d.step().lanes[0].handle == hs[0]
    assert d.step().lanes[0].handle == hs[1]
    plan = d.step()  # two running: the third waits for a slot
    assert plan.shape == decode(2)
    assert p.phase(hs[0]) is Phase.RETIRED  # both reached max_output_tokens 2
    assert d.step().lanes[0].handle == hs[2]


def test_decode_queues_behind_decode_but_prefill_drains_the_window() -> None:
    """QUEUE-10, QUEUE-11, QUEUE-12 in the baselines' window."""
    p = FcfsPolicy(catalog=CATALOG)
    p.admit(prompt_len=10, max_output_tokens=8)
    d = Driver(p)
    d.step()
    first = p.plan()
    assert first is not None and first.shape.is_generation
    p.commit(first, Fence(10))
    second = p.plan()
    assert second is not None and p.window_ready(second)
    p.commit(second, Fence(11))
    third = p.plan()
    assert third is not None and not p.window_ready(third)
    with pytest.raises(WindowNotReady):
        p.commit(third, Fence(12))
    # A new prompt needs an empty window.
    p.admit(prompt_len=10, max_output_tokens=8)
    prompt_plan = p.plan()
    assert prompt_plan is not None and prompt_plan.requires_empty_window


def test_commit_rejects_a_cancelled_request_and_malformed_lanes_fail_alone() -> None:
    p = FcfsPolicy(catalog=CATALOG)
    a = p.admit(prompt_len=10, max_output_tokens=8)
    plan = p.plan()
    assert plan is not None
    p.cancel(a)
    with pytest.raises(StaleEpochError):
        p.commit(plan, Fence(1))
    b = p.admit(prompt_len=10, max_output_tokens=8)
    plan = p.plan()
    assert plan is not None and plan.lanes[0].handle == b
    p.commit(plan, Fence(2))
    out = p.complete(Fence(2), [CompletionRecord(handle=b, epoch=0, prompt_tokens=3)],
                     ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    assert [t.finish for t in out] == [FinishKind.ERROR]
    assert p.statistics().failed_lanes == 1
    assert set(p.take_released()) == {a, b}


def test_finished_requests_take_a_terminal_snapshot_before_release() -> None:
    p = FcfsPolicy(catalog=(*CATALOG, SNAPSHOT))
    a = p.admit(prompt_len=10, max_output_tokens=1)
    d = Driver(p)
    d.step()
    assert p.phase(a) is Phase.TERMINAL and p.take_released() == []
    plan = d.step()
    assert plan.shape == SNAPSHOT and plan.lanes[0].role is LaneRole.TERMINAL
    assert p.take_released() == [RequestHandle(a)]
    assert p.plan() is None
