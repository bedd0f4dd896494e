"""completion-validator decisions, called directly. Covers ACCT-6 (every lane checked
before anything changes; a malformed lane fails only itself), QUEUE-47 (accepted extent
within the lane's ceiling)."""

from __future__ import annotations

from actors.completion_validator import check_frame
from actors.messages import Fence, FrameOrder, FrameOutcome, LaneContext, RequestHandle, StateRow
from gpu.backends.protocol import Completion, ProgramFault
from gpu.frames import RESULT_KEY, DecodeFrame, LaneSample, StepResult
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape
from policy.types import Lane, LaneRole, ScheduledPlan, ScheduledStep, SelectionReason

DECODE2 = GraphShape(kind=GraphKind.DECODE, batch_capacity=2, token_capacity=1,
                     packed_capacity=2)
TIMING = ExecutionTiming(device_intervals_ns=(1_000,), wall_ns=2_000)


def order(ceilings: tuple[int, int] = (1, 1)) -> FrameOrder:
    lanes = tuple(Lane(handle=RequestHandle(h), epoch=3, role=LaneRole.DECODE,
                       token_ceiling=c) for h, c in zip((0, 1), ceilings, strict=True))
    plan = ScheduledPlan(
        step=ScheduledStep(shape=DECODE2, lanes=lanes), estimated_duration_ns=1_000,
        scaled_score=1.0, scale_exponent=0, duration_known=True, stale=False,
        reason=SelectionReason.ORDINARY, requires_empty_window=False, planned_at_ns=0,
        start_ns=0, useful_value=1.0,
    )
    contexts = tuple(LaneContext(handle=RequestHandle(h), epoch=3, row=StateRow(h + 10),
                                 samples=True, eos_token_ids=(2,)) for h in (0, 1))
    return FrameOrder(fence=Fence(7), plan=plan, frame=DecodeFrame(rows=(10, 11)),
                      lanes=contexts)


def outcome(o: FrameOrder, samples: tuple[LaneSample, ...]) -> FrameOutcome:
    result = StepResult(samples=samples)
    return FrameOutcome(order=o, completion=Completion(shape=DECODE2,
                                                       outputs={RESULT_KEY: result},
                                                       timing=TIMING),
                        fault=None, wall_ns=2_000)


def good(row: int, token: int = 5) -> LaneSample:
    return LaneSample(row=row, token=token, logprob=-0.25, finite=True)


def test_valid_frame_records_tokens_and_eos() -> None:
    o = order()
    check = check_frame(o, outcome(o, (good(10), good(11, token=2))), vocab_size=50)
    assert [r.token_ids for r in check.records] == [(5,), (2,)]
    assert [r.terminated for r in check.records] == [False, True]
    assert all(r.ok for r in check.records) and check.failures == ()
    assert check.logprobs == ((-0.25,), (-0.25,))


def test_acct_6_one_bad_lane_fails_alone() -> None:
    o = order()
    check = check_frame(o, outcome(o, (good(10, token=50), good(11))), vocab_size=50)
    assert [r.ok for r in check.records] == [False, True]
    assert len(check.failures) == 1 and "vocabulary" in check.failures[0].message
    assert check.records[1].token_ids == (5,)


def test_positive_logprob_and_wrong_row_are_malformed() -> None:
    o = order()
    bad = LaneSample(row=10, token=5, logprob=0.5, finite=True)
    check = check_frame(o, outcome(o, (bad, good(12))), vocab_size=50)
    assert [r.ok for r in check.records] == [False, False]
    assert "positive" in check.failures[0].message and "row" in check.failures[1].message


def test_queue_47_output_beyond_ceiling_is_malformed() -> None:
    o = order(ceilings=(0, 1))
    check = check_frame(o, outcome(o, (good(10), good(11))), vocab_size=50)
    assert [r.ok for r in check.records] == [False, True]
    assert "ceiling" in check.failures[0].message


def test_sample_count_mismatch_fails_the_frame() -> None:
    o = order()
    check = check_frame(o, outcome(o, (good(10),)), vocab_size=50)
    assert not any(r.ok for r in check.records) and len(check.failures) == 2


def test_program_fault_fails_every_lane_with_its_message() -> None:
    o = order()
    fault = ProgramFault(DECODE2, "execute", RuntimeError("nan in attention"))
    check = check_frame(o, FrameOutcome(order=o, completion=None, fault=fault, wall_ns=5),
                        vocab_size=50)
    assert not any(r.ok for r in check.records)
    assert all("nan in attention" in f.message for f in check.failures)


def test_draft_proposals_of_valid_lanes_are_passed_on() -> None:
    """A width-one step's learned-draft proposals reach the planner for valid lanes
    only; -1 (no draft ran) and ids outside the vocabulary are dropped."""
    from dataclasses import replace

    o = order()
    samples = (replace(good(10), draft_proposal=7), replace(good(11), draft_proposal=-1))
    assert check_frame(o, outcome(o, samples), vocab_size=50).draft_proposals == (
        (RequestHandle(0), 7),)
    failed = (replace(good(10, token=50), draft_proposal=7), replace(good(11), draft_proposal=60))
    assert check_frame(o, outcome(o, failed), vocab_size=50).draft_proposals == ()
