"""completion-validator on complete speculative rounds, called directly. Covers ACCT-6
(a malformed lane fails only itself), SPEC-19 and QUEUE-47 (accepted prefix within the
lane's ceiling and the program's P), ACC-28 (survival sidecars reach completion), and a
burst cut after its first EOS."""

from __future__ import annotations

import numpy as np

from actors.completion_validator import check_frame
from actors.messages import Fence, FrameOrder, FrameOutcome, LaneContext, RequestHandle, StateRow
from gpu.backends.protocol import Completion
from gpu.frames import RESULT_KEY
from gpu.programs.speculative_frames import SpeculativeFrame, SpeculativeLane, SpeculativeResult
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.types import Lane, LaneRole, ScheduledPlan, ScheduledStep, SelectionReason

SPEC = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=3,
                  proposal_depth=2, packed_capacity=6, binding=TargetBinding.QUERY_LENGTH)
TIMING = ExecutionTiming(device_intervals_ns=(1_000,), wall_ns=2_000)


def order(ceilings: tuple[int, int] = (3, 3)) -> FrameOrder:
    lanes = tuple(Lane(handle=RequestHandle(h), epoch=1, role=LaneRole.DECODE,
                       token_ceiling=c) for h, c in zip((0, 1), ceilings, strict=True))
    plan = ScheduledPlan(
        step=ScheduledStep(shape=SPEC, lanes=lanes), estimated_duration_ns=1_000,
        scaled_score=1.0, scale_exponent=0, duration_known=True, stale=False,
        reason=SelectionReason.ORDINARY, requires_empty_window=False, planned_at_ns=0,
        start_ns=0, useful_value=1.0)
    contexts = tuple(LaneContext(handle=RequestHandle(h), epoch=1, row=StateRow(h + 4),
                                 samples=True, eos_token_ids=(2,)) for h in (0, 1))
    return FrameOrder(fence=Fence(3), plan=plan,
                      frame=SpeculativeFrame(rows=(4, 5), limits=ceilings), lanes=contexts)


def lane(row: int, tokens: tuple[int, ...], *, evaluated: int = 2, rows: int = 3,
         logprob: float = -0.5) -> SpeculativeLane:
    return SpeculativeLane(
        row=row, tokens=tokens, logprobs=tuple(logprob for _ in tokens),
        top_logprobs=tuple(() for _ in tokens), finite=True, accepted=len(tokens) - 1,
        evaluated=evaluated, target_rows=rows, proposed=evaluated,
        survival=tuple(0.5 for _ in range(evaluated)))


def outcome(o: FrameOrder, lanes: tuple[SpeculativeLane, ...]) -> FrameOutcome:
    result = SpeculativeResult(lanes=lanes, confidence=np.full((2, 2, 2), 0.25, np.float32),
                               survival=np.zeros((2, 2), np.float32))
    return FrameOutcome(order=o, completion=Completion(shape=SPEC, outputs={RESULT_KEY: result},
                                                       timing=TIMING),
                        fault=None, wall_ns=2_000)


def test_spec_19_accepted_prefixes_become_bursts_with_sidecars() -> None:
    o = order()
    check = check_frame(o, outcome(o, (lane(4, (7, 8, 9)), lane(5, (6,)))), vocab_size=50)
    assert [r.token_ids for r in check.records] == [(7, 8, 9), (6,)]
    assert check.failures == () and check.logprobs == ((-0.5,) * 3, (-0.5,))
    assert check.rounds is not None
    assert [(r.accepted, r.evaluated, r.survival) for r in check.rounds.lanes] == [
        (2, 2, (0.5, 0.5)), (0, 2, (0.5, 0.5))]
    assert check.rounds.confidence[1][0] == (0.25, 0.25)


def test_queue_47_prefix_beyond_the_ceiling_fails_only_its_lane() -> None:
    o = order(ceilings=(2, 3))
    check = check_frame(o, outcome(o, (lane(4, (7, 8, 9)), lane(5, (6, 7)))), vocab_size=50)
    assert [r.ok for r in check.records] == [False, True]
    assert "ceiling" in check.failures[0].message
    assert check.records[1].token_ids == (6, 7)


def test_target_rows_beyond_p_fail_the_frame() -> None:
    o = order()
    check = check_frame(o, outcome(o, (lane(4, (7,), rows=4), lane(5, (6,), rows=3))),
                        vocab_size=50)
    assert not any(r.ok for r in check.records) and "P=6" in check.failures[0].message


def test_acct_6_bad_token_row_or_logprob_fail_their_lane() -> None:
    o = order()
    check = check_frame(o, outcome(o, (lane(4, (7, 99)), lane(6, (6,)))), vocab_size=50)
    assert [r.ok for r in check.records] == [False, False]
    assert "vocabulary" in check.failures[0].message and "row" in check.failures[1].message
    check = check_frame(o, outcome(o, (lane(4, (7,), logprob=0.5), lane(5, (6,)))),
                        vocab_size=50)
    assert [r.ok for r in check.records] == [False, True]


def test_burst_ends_at_its_first_eos() -> None:
    o = order()
    check = check_frame(o, outcome(o, (lane(4, (7, 2, 9)), lane(5, (2,)))), vocab_size=50)
    assert [r.token_ids for r in check.records] == [(7, 2), (2,)]
    assert [r.terminated for r in check.records] == [True, True]
    assert check.logprobs[0] == (-0.5, -0.5)


def test_a_missing_round_fails_every_lane() -> None:
    o = order()
    check = check_frame(o, outcome(o, (lane(4, (7,)),)), vocab_size=50)
    assert not any(r.ok for r in check.records)
