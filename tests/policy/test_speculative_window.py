"""The two-slot window in speculative mode (seed: *Planning and the execution queue*).

With speculative programs loaded, an ordinary decode and a complete speculative round of
known, fresh cost queue behind a generation frame exactly as in ordinary mode
(QUEUE-10, QUEUE-11); a queued round bounds the next decision's output room by
``min(lane ceiling, P)`` (QUEUE-47, QUEUE-48); ``window_open`` is False exactly when no
plan could be submitted (QUEUE-10, QUEUE-12, QUEUE-39), which lets the planner skip
planning then.
"""

from __future__ import annotations

from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler
from policy.types import CompletionRecord, Fence, Phase, RequestHandle, ScheduledPlan

MS = 1_000_000
DECODE4 = GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                     packed_capacity=4)
PREFILL64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)


def spec(w: int, b: int = 4) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w,
                      binding=TargetBinding.QUERY_LENGTH)


SHAPES = (DECODE4, PREFILL64, spec(1), spec(2), spec(4))
"""A synthetic measured catalog: decode 10 ms, a width-W round 10 + W/2 ms."""


def measured(mode: SpeculationMode = SpeculationMode.ADAPTIVE) -> Scheduler:
    s = Scheduler(catalog=SHAPES, speculation=SpeculationSettings(mode=mode))
    s.advance_to(1_000 * MS)
    for shape in SHAPES:
        cost = 10 * MS if shape.kind is not GraphKind.SPECULATIVE \
            else (10 + shape.token_capacity // 2) * MS
        s.estimates.observe(shape, cost, s.now_ns)
    return s


def decoders(s: Scheduler, means: tuple[float, ...], n: int = 4,
             max_tokens: int = 500) -> list[RequestHandle]:
    out = []
    for _ in range(n):
        h = s.admit(prompt_len=64, max_output_tokens=max_tokens)
        rec = s.request(h)
        rec.phase = Phase.DECODE
        rec.prompt_cursor = 64
        rec.output_committed = 1
        rec.last_visible_ns = s.now_ns - 5 * MS
        s.preseed_acceptance(h, means)
        out.append(h)
    return out


def submit(s: Scheduler, fence: int) -> ScheduledPlan:
    plan = s.plan()
    assert plan is not None and s.window_ready(plan), plan
    s.commit(plan, Fence(fence))
    return plan


def test_queue_11_adaptive_decode_queues_behind_decode() -> None:
    """Covers QUEUE-10, QUEUE-11, QUEUE-14: with speculative programs loaded and low
    acceptance, the ordinary decode winner needs no feedback, so a second decode is
    queued behind the first; then the window is full and ``window_open`` says so."""
    s = measured()
    decoders(s, means=(0.02, 0.01, 0.0))
    first = submit(s, 1)
    assert first.shape == DECODE4 and not first.requires_empty_window
    assert s.window_open()
    second = submit(s, 2)
    assert second.shape == DECODE4
    assert s.in_flight() == (Fence(1), Fence(2))
    assert not s.window_open()
    third = s.plan()
    assert third is not None and not s.window_ready(third)


def test_queue_11_47_48_round_queues_behind_round_within_output_room() -> None:
    """Covers QUEUE-11, QUEUE-38, QUEUE-47, QUEUE-48: a measured ordinary speculative
    round queues behind another; each lane of the second round fits the output room
    left after the first round's advance bound ``min(ceiling, P)``."""
    s = measured()
    hs = decoders(s, means=(0.95, 0.9, 0.85), max_tokens=7)
    first = submit(s, 1)
    assert first.shape == spec(4) and not first.requires_empty_window
    assert all(lane.token_ceiling == 4 for lane in first.lanes)
    second = submit(s, 2)
    assert second.shape.kind is GraphKind.SPECULATIVE
    assert second.start_ns == first.start_ns + first.estimated_duration_ns
    for lane in second.lanes:
        assert lane.token_ceiling <= 7 - 1 - min(4, first.shape.packed_capacity)
    for h in hs:
        rec = s.request(h)
        assert rec.output_committed + rec.queued_outputs <= rec.max_output_tokens


def test_queue_11_decode_queues_behind_round_and_round_behind_decode() -> None:
    """Covers QUEUE-11: generation frames of both kinds queue behind each other."""
    s = measured()
    hs = decoders(s, means=(0.95, 0.9, 0.85))
    first = submit(s, 1)
    assert first.shape == spec(4)
    # Acceptance collapses for every request: the next winner is an ordinary decode.
    for h in hs:
        s.preseed_acceptance(h, (0.0, 0.0, 0.0))
    second = submit(s, 2)
    assert second.shape == DECODE4
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(5,))
               for lane in first.lanes]
    s.advance_to(s.now_ns + first.estimated_duration_ns)
    s.complete(Fence(1), records, ExecutionTiming(device_intervals_ns=(12 * MS,),
                                                  wall_ns=12 * MS))
    for h in hs:
        s.preseed_acceptance(h, (0.95, 0.9, 0.85))
    third = submit(s, 3)
    assert third.shape.kind is GraphKind.SPECULATIVE
    assert s.in_flight() == (Fence(2), Fence(3))


def test_queue_12_34_39_window_open_is_false_exactly_when_nothing_can_be_submitted() -> None:
    """Covers QUEUE-10, QUEUE-12, QUEUE-34, QUEUE-39: ``window_open`` is False with both
    slots taken, behind a frame needing feedback, and after an overrun until the next
    completion; whenever it is False the scheduler's plan is not submit-ready."""
    s = measured()
    decoders(s, means=(0.02, 0.01, 0.0))
    assert s.window_open()  # empty window
    first = submit(s, 1)
    assert s.window_open()
    s.advance_to(first.start_ns + first.estimated_duration_ns + 1)  # overrun (OPEN-31)
    assert not s.window_open()
    plan = s.plan()
    assert plan is not None and not s.window_ready(plan)
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(5,))
               for lane in first.lanes]
    s.complete(Fence(1), records, ExecutionTiming(device_intervals_ns=(10 * MS,),
                                                  wall_ns=10 * MS))
    assert s.window_open()  # the completion supplied feedback (QUEUE-39)
    # A frame needing feedback (an unknown program) closes the window behind it.
    unknown = Scheduler(catalog=SHAPES, speculation=SpeculationSettings())
    unknown.advance_to(1_000 * MS)
    decoders(unknown, means=(0.5, 0.25, 0.125))
    discovery = submit(unknown, 1)
    assert discovery.requires_empty_window
    assert not unknown.window_open()
    behind = unknown.plan()
    assert behind is None or not unknown.window_ready(behind)
