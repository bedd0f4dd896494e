"""completion-validator bounds on speculative lanes: every token id and drafted token in
``[0, vocab)``, every survival product and confidence estimate a probability in
``[0, 1]``. A lane that breaks a bound fails alone; the frame's other lanes are
accepted. Covers ACCT-6, SPEC-19, ACC-15, ACC-27, ACC-28."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from actors.completion_validator import FrameCheck, check_frame
from actors.messages import Fence, FrameOrder, FrameOutcome, LaneContext, RequestHandle, StateRow
from gpu.backend import Completion
from gpu.frames import RESULT_KEY
from gpu.programs.speculative import SpeculativeFrame, SpeculativeLane, SpeculativeResult
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.types import Lane, LaneRole, ScheduledPlan, ScheduledStep, SelectionReason

VOCAB = 50
SPEC = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=3,
                  proposal_depth=2, packed_capacity=12, binding=TargetBinding.QUERY_LENGTH)
HANDLES = (0, 1, 2)


def order() -> FrameOrder:
    lanes = tuple(Lane(handle=RequestHandle(h), epoch=1, role=LaneRole.DECODE,
                       token_ceiling=3) for h in HANDLES)
    plan = ScheduledPlan(
        step=ScheduledStep(shape=SPEC, lanes=lanes), estimated_duration_ns=1_000,
        scaled_score=1.0, scale_exponent=0, duration_known=True, stale=False,
        reason=SelectionReason.ORDINARY, requires_empty_window=False, planned_at_ns=0,
        start_ns=0, useful_value=1.0)
    contexts = tuple(LaneContext(handle=RequestHandle(h), epoch=1, row=StateRow(h + 4),
                                 samples=True, eos_token_ids=(2,)) for h in HANDLES)
    return FrameOrder(fence=Fence(3), plan=plan,
                      frame=SpeculativeFrame(rows=(4, 5, 6), limits=(3, 3, 3)),
                      lanes=contexts)


def lane(h: int, **changes: object) -> SpeculativeLane:
    good = SpeculativeLane(
        row=h + 4, tokens=(7, 8, 9), logprobs=(-0.5, -0.5, -0.5),
        top_logprobs=((), (), ()), finite=True, accepted=2, evaluated=2, target_rows=3,
        proposed=2, survival=(0.75, 0.5), drafts=(7, 8))
    return dataclasses.replace(good, **changes)  # type: ignore[arg-type]


def check(lanes: tuple[SpeculativeLane, ...], confidence: np.ndarray | None = None
          ) -> FrameCheck:
    o = order()
    if confidence is None:
        confidence = np.full((2, 4, 2), 0.25, np.float32)
    result = SpeculativeResult(lanes=lanes, confidence=confidence,
                               survival=np.zeros((4, 2), np.float32))
    outcome = FrameOutcome(
        order=o, completion=Completion(
            shape=SPEC, outputs={RESULT_KEY: result},
            timing=ExecutionTiming(device_intervals_ns=(1_000,), wall_ns=2_000)),
        fault=None, wall_ns=2_000)
    return check_frame(o, outcome, vocab_size=VOCAB)


def only_lane_one_fails(result: FrameCheck, word: str) -> None:
    assert [r.ok for r in result.records] == [True, False, True]
    assert len(result.failures) == 1 and result.failures[0].handle == RequestHandle(1)
    assert word in result.failures[0].message
    assert result.records[0].token_ids == (7, 8, 9) == result.records[2].token_ids


@pytest.mark.parametrize("tokens", [(7, 8, VOCAB), (VOCAB, 8, 9), (7, -1, 9)])
def test_token_id_at_the_vocabulary_size_fails_only_its_lane(tokens: tuple[int, ...]) -> None:
    only_lane_one_fails(check((lane(0), lane(1, tokens=tokens), lane(2))), "vocabulary")


def test_token_id_below_the_vocabulary_size_passes() -> None:
    result = check((lane(0), lane(1, tokens=(7, 8, VOCAB - 1)), lane(2)))
    assert all(r.ok for r in result.records) and result.failures == ()


def test_drafted_token_at_the_vocabulary_size_fails_only_its_lane() -> None:
    only_lane_one_fails(check((lane(0), lane(1, drafts=(7, VOCAB)), lane(2))), "vocabulary")


@pytest.mark.parametrize("value", [1.2, math.nan, -0.1, math.inf])
def test_survival_outside_zero_one_fails_only_its_lane(value: float) -> None:
    only_lane_one_fails(check((lane(0), lane(1, survival=(0.5, value)), lane(2))),
                        "survival")


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_survival_at_the_bounds_passes(value: float) -> None:
    result = check((lane(0), lane(1, survival=(value, value)), lane(2)))
    assert all(r.ok for r in result.records)


@pytest.mark.parametrize("value", [1.2, math.nan, -0.5])
@pytest.mark.parametrize("plane", [0, 1])
def test_confidence_outside_zero_one_fails_only_its_lane(plane: int, value: float) -> None:
    """ACC-15: a confidence estimate must be a probability; slot 1 is lane 1's."""
    confidence = np.full((2, 4, 2), 0.25, np.float32)
    confidence[plane, 1, 1] = value
    only_lane_one_fails(check((lane(0), lane(1), lane(2)), confidence), "confidence")
    assert check((lane(0), lane(1), lane(2))).failures == ()


def test_survival_within_rounding_of_one_is_clamped() -> None:
    result = check((lane(0), lane(1, survival=(1.00005, 0.5)), lane(2)))
    assert all(r.ok for r in result.records)
    assert result.rounds is not None and result.rounds.lanes[1].survival == (1.0, 0.5)
